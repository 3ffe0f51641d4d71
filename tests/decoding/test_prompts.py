"""Demo prompts come from validation files only, deterministically, and end at a def."""

from specjax.data.corpus import split_of
from specjax.decoding.prompts import held_out_prompts


def test_prompts_are_held_out_and_deterministic():
    a = held_out_prompts(n=12, seed=0)
    assert a == held_out_prompts(n=12, seed=0)
    assert a != held_out_prompts(n=12, seed=1)
    assert len(a) == 12 and len({p["id"] for p in a}) == 12
    for p in a:
        assert split_of(p["source"]) == "val"
        assert "def " in p["prompt"] and 0 < len(p["prompt"]) <= 1500
