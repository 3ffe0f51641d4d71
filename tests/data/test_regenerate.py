"""specjax.regenerate: prompts from training files only, continuations equal to an
independent greedy reference (cache-free forwards, argmax), streams laid out as
documented, resume after a kill, and clean errors."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.data import regenerate as rg
from specjax.data.corpus import split_of
from specjax.decoding.prompts import held_out_prompts
from specjax.tools import regenerate as rt


def test_training_prompts_come_from_training_files_only():
    a = rg.training_prompts(per_file=2, seed=0)
    assert a == rg.training_prompts(per_file=2, seed=0)
    assert len({p["id"] for p in a}) == len(a) > 1000
    assert all(split_of(p["source"]) == "train" for p in a)
    assert all(0 < len(p["prompt"]) <= 800 for p in a)
    # A docstring longer than the cap trims its own def line away (as in specjax.decoding.prompts).
    assert sum("def " in p["prompt"] for p in a) > 0.95 * len(a)
    bundled = {p["source"] for p in held_out_prompts(50)}
    assert not bundled & {p["source"] for p in a}
    # The data set's own val split holds whole files.
    by_split = {s: {p["source"] for p in a if p["split"] == s} for s in ("train", "val")}
    assert by_split["val"] and not by_split["train"] & by_split["val"]


def _greedy_reference(target_dir, prompt_ids, n, eos):
    """Cache-free full forwards, argmax of the last position: no KV cache, no engine."""
    from specjax.models.checkpoint import load_model

    model = load_model(target_dir, dtype=jnp.float32)
    ids, out = list(prompt_ids), []
    for _ in range(n):
        toks = jnp.asarray([ids], jnp.int32)
        logits = model(toks, jnp.arange(len(ids), dtype=jnp.int32)[None], None).logits
        nxt = int(np.argmax(np.asarray(logits[0, -1], np.float64)))
        out.append(nxt)
        ids.append(nxt)
        if nxt == eos:
            break
    return out


def test_regenerate_end_to_end_and_resume(tiny_demo, tmp_path, monkeypatch):
    target = str(tiny_demo / "target")
    out = str(tmp_path / "regen")
    m = rt.regenerate(target, out, per_file=1, limit=5, batch_size=4, max_new_tokens=6,
                      val_fraction=0.5)
    recs = [json.loads(line) for line in open(os.path.join(out, rg.GENERATIONS))]
    assert len(recs) == 5 and {r["split"] for r in recs} == {"train", "val"}
    eos = m["eos_id"]
    for r in recs[:2]:
        assert r["output_ids"] == _greedy_reference(target, r["prompt_ids"], 6, eos)
    # Streams: per record prompt + continuation + EOS, records in file order per split.
    for split in ("train", "val"):
        want = []
        for r in (r for r in recs if r["split"] == split):
            want += r["prompt_ids"] + r["output_ids"]
            if r["output_ids"][-1:] != [eos]:
                want.append(eos)
        got = np.load(os.path.join(out, f"{split}.npy"))
        assert got.dtype == np.uint16 and got.tolist() == want
        assert m["splits"][split]["tokens"] == len(want)

    # A kill mid-write leaves a torn last line: it is dropped and that prompt redone.
    path = os.path.join(out, rg.GENERATIONS)
    lines = open(path).read().splitlines(keepends=True)
    with open(path, "w") as f:
        f.writelines(lines[:3])
        f.write(lines[3][:20])
    m2 = rt.regenerate(target, out, per_file=1, limit=5, batch_size=4, max_new_tokens=6,
                       val_fraction=0.5)
    again = [json.loads(line) for line in open(path)]
    assert sorted(again, key=lambda r: r["id"]) == sorted(recs, key=lambda r: r["id"])
    assert m2["splits"] == m["splits"]

    # Nothing left to do: no model is loaded at all.
    monkeypatch.setattr("specjax.models.checkpoint.load_model", lambda *a, **k: 1 / 0)
    rt.regenerate(target, out, per_file=1, limit=5, batch_size=4, max_new_tokens=6,
                  val_fraction=0.5)


@pytest.mark.slow  # an option of the run that test_regenerate_end_to_end_and_resume makes
def test_skip_seen_leaves_out_earlier_prompts(tiny_demo, tmp_path, monkeypatch):
    """--skip-seen: a set made with another seed and more sites per file holds exactly the
    def sites the earlier set lacks; the earlier set's file is read, never rewritten (a
    torn last line there stays)."""
    target = str(tiny_demo / "target")
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    rt.regenerate(target, first, per_file=1, limit=6, batch_size=8, max_new_tokens=2)
    path = os.path.join(first, rg.GENERATIONS)
    recs = [json.loads(line) for line in open(path)]
    with open(path, "a") as f:
        f.write('{"id": "torn')
    before = open(path).read()
    seen, files = {r["id"] for r in recs}, {r["source"] for r in recs}
    # The second set draws from the same six files only, so that it must drop some ids.
    every = rg.training_prompts
    monkeypatch.setattr(rt, "training_prompts", lambda *a, **k: [
        p for p in every(*a, **k) if p["source"] in files])
    candidates = {p["id"] for p in rt.training_prompts(3, 1)}
    assert seen & candidates and candidates - seen
    m = rt.regenerate(target, second, per_file=3, seed=1, batch_size=8, max_new_tokens=2,
                      skip_seen=(first,))
    got = [json.loads(line)["id"] for line in open(os.path.join(second, rg.GENERATIONS))]
    assert sorted(got) == sorted(candidates - seen)
    assert m["skip_seen"] == [os.path.abspath(first)]
    assert open(path).read() == before


@pytest.mark.slow  # resuming is tested by test_regenerate_end_to_end_and_resume
def test_time_limit_stops_between_batches_and_resumes(tiny_demo, tmp_path):
    """--time-limit: the first batch always runs, no batch starts past the limit, the
    streams hold what is done, and a second call completes the same set of prompts."""
    target = str(tiny_demo / "target")
    out, full = str(tmp_path / "cut"), str(tmp_path / "full")
    kw = dict(per_file=1, limit=5, batch_size=2, max_new_tokens=3, val_fraction=0.5)
    m = rt.regenerate(target, out, time_limit_s=1e-9, **kw)
    recs = [json.loads(line) for line in open(os.path.join(out, rg.GENERATIONS))]
    assert len(recs) == 2
    assert sum(c["prompts"] for c in m["splits"].values()) == 2
    m2 = rt.regenerate(target, out, **kw)
    m_full = rt.regenerate(target, full, **kw)
    def by_id(d):
        return sorted((json.loads(line) for line in open(os.path.join(d, rg.GENERATIONS))),
                      key=lambda r: r["id"])
    assert by_id(out) == by_id(full)
    assert {s: c["prompts"] for s, c in m2["splits"].items()} == {
        s: c["prompts"] for s, c in m_full["splits"].items()}


@pytest.mark.parametrize("argv, msg", [
    (["--batch-size", "0"], "--batch-size=0 must be >= 1"),
    (["--time-limit", "0"], "--time-limit=0.0 must be > 0"),
    (["--target", "/nonexistent"], "/nonexistent"),
    (["--skip-seen", "/nonexistent"], "--skip-seen /nonexistent: no generations.jsonl"),
])
def test_bad_input_exits_2(tmp_path, capsys, argv, msg):
    out = tmp_path / "o"
    assert rt.main(["--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1
    assert not out.exists()


def test_bad_flag_value_exits_2_with_one_line(tmp_path, capsys):
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        rt.main(["--out", str(out), "--dtype", "float16"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "float16" in err and err.count("\n") == 1
    assert not out.exists()


def test_root_takes_prompts_from_another_library(tiny_demo, tmp_path):
    """--root: the prompts come from that directory's training files (another Python's
    library), and the manifest records it."""
    root = tmp_path / "lib"
    body = "".join(f"    x{j} = {j}\n" for j in range(5))
    for i in range(40):
        (root / f"pkg{i % 4}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i % 4}" / f"mod{i}.py").write_text(
            f'def f{i}(a):\n    """Doc {i}."""\n{body}    return a\n')
    want = {p["id"] for p in rg.training_prompts(per_file=1, root=str(root))}
    assert want and all(i.split(":")[0].startswith("pkg") for i in want)
    out = str(tmp_path / "regen")
    m = rt.regenerate(str(tiny_demo / "target"), out, per_file=1, batch_size=8,
                      max_new_tokens=2, root=str(root))
    got = {json.loads(line)["id"] for line in open(os.path.join(out, rg.GENERATIONS))}
    assert got == want
    assert m["root"] == str(root)


# ----------------------------------------------------------------------------- chat data

@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    from specjax.testing.chat import make_chat_target

    return make_chat_target(str(tmp_path_factory.mktemp("chat") / "target"), "qwen3")


def test_regenerate_answers_the_users_conversations(chat_target, tmp_path, monkeypatch):
    """--data: prompts are transformers' chat rendering up to the last user turn, answers
    equal an independent greedy reference stopping at <|im_end|>, and the streams carry
    loss masks that are 1 exactly on the answers; a torn line resumes."""
    import transformers

    from specjax.testing.chat import sample_conversations, write_conversations

    data = write_conversations(str(tmp_path / "c.jsonl"), "sharegpt", 6, seed=2)
    convs = sample_conversations(6, seed=2)
    tok = transformers.AutoTokenizer.from_pretrained(chat_target)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    # the random target never writes <|im_end|> itself: make its first answer token one
    first = _greedy_reference(chat_target, _chat_ids(tok, convs[0]), 1, -1)[0]
    monkeypatch.setattr("specjax.data.chat.end_of_turn_ids", lambda t: (first,))
    out = str(tmp_path / "regen")
    m = rt.regenerate(chat_target, out, data=data, batch_size=4, max_new_tokens=5,
                      val_fraction=0.3)
    recs = {r["id"]: r for r in map(json.loads, open(os.path.join(out, rg.GENERATIONS)))}
    assert sorted(recs) == [f"c{i}" for i in range(6)]
    assert {r["split"] for r in recs.values()} == {"train", "val"}
    for i, msgs in enumerate(convs):
        r = recs[f"c{i}"]
        assert r["prompt_ids"] == _chat_ids(tok, msgs)
        want = _greedy_reference(chat_target, r["prompt_ids"], 5, first)
        assert r["output_ids"] == want, i
    assert recs["c0"]["output_ids"] == [first]  # stopped at the end of turn
    stops = m["stop_ids"]
    assert stops[0] == first and eot in stops
    in_file = [json.loads(line) for line in open(os.path.join(out, rg.GENERATIONS))]
    for split in ("train", "val"):
        ids, mask = [], []
        for r in (r for r in in_file if r["split"] == split):  # streams: in file order
            ids += r["prompt_ids"] + r["output_ids"]
            mask += [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"])
            if r["output_ids"][-1] not in stops:  # cut by --max-new-tokens
                ids, mask = ids + [first], mask + [0]
        got_ids = np.load(os.path.join(out, f"{split}.npy"))
        got_mask = np.load(os.path.join(out, f"{split}_loss_mask.npy"))
        assert got_ids.tolist() == ids and got_mask.tolist() == mask
        assert got_mask.dtype == np.uint8
        assert m["splits"][split]["target_tokens"] == sum(mask)
    # a torn last line is redone, and the answers come out the same
    path = os.path.join(out, rg.GENERATIONS)
    lines = open(path).read().splitlines(keepends=True)
    with open(path, "w") as f:
        f.writelines(lines[:4])
        f.write(lines[4][:15])
    rt.regenerate(chat_target, out, data=data, batch_size=4, max_new_tokens=5,
                  val_fraction=0.3)
    again = {r["id"]: r for r in map(json.loads, open(path))}
    assert again == recs


def _chat_ids(tok, msgs):
    last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    r = tok.apply_chat_template(msgs[:last + 1], add_generation_prompt=True, tokenize=True)
    return list(r["input_ids"]) if hasattr(r, "keys") else list(r)


@pytest.mark.parametrize("case,msg", [
    ("no_template", "--data needs a chat template"),
    ("bad_role", "line 2: message 0 has unknown"),
    ("no_user", "line 1:"),
    ("dup_id", "repeats line 1"),
])
def test_bad_conversations_exit_2(chat_target, tiny_demo, tmp_path, capsys, case, msg):
    good = {"id": "a", "messages": [{"role": "user", "content": "hi"}]}
    lines = {"no_template": [good],
             "bad_role": [good, {"messages": [{"role": "bot", "content": "x"}]}],
             "no_user": [{"messages": [{"role": "system", "content": "x"}]}],
             "dup_id": [good, good]}[case]
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    target = str(tiny_demo / "target") if case == "no_template" else chat_target
    out = tmp_path / "o"
    assert rt.main(["--target", target, "--data", str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1, err
    assert not out.exists()
