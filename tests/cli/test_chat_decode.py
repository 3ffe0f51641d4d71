"""decode.py with conversations: prompt ids equal transformers' apply_chat_template with the
generation prompt, the template's end-of-turn token stops an answer, and chat without a
chat template is a one-line error (exit 2, no output file)."""

from __future__ import annotations

import json

import pytest

import decode
from specjax.data import chat
from specjax.testing.chat import make_chat_target, sample_conversations


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat_targets")
    return {s: make_chat_target(str(d / s), s) for s in ("qwen3", "llama3")}


def _ids(result):
    return list(result["input_ids"]) if hasattr(result, "keys") else list(result)


def _decode(tmp_path, target, *extra):
    out = tmp_path / "out.jsonl"
    rc = decode.main(["--target", target, "--drafter", "none", "--max-new-tokens", "6",
                      "--output", str(out), "--show", "0", "--no-compare-ar",
                      "--compile-cache", "none", *extra])
    assert rc == 0
    return [json.loads(x) for x in out.read_text().splitlines()]


@pytest.mark.parametrize("style", ["qwen3", "llama3"])
def test_conversation_lines_render_as_transformers_does(targets, tmp_path, style):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(targets[style])
    convs = sample_conversations(4, seed=1)
    convs[1] = convs[1] + [{"role": "user", "content": "And one more question?"}]
    path = tmp_path / "p.jsonl"
    with open(path, "w") as f:
        for i, msgs in enumerate(convs):
            if i % 2:  # ShareGPT and OpenAI lines in one file
                names = {"system": "system", "user": "human", "assistant": "gpt"}
                f.write(json.dumps({"id": f"c{i}", "conversations": [
                    {"from": names[m["role"]], "value": m["content"]} for m in msgs]}) + "\n")
            else:
                f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    recs = _decode(tmp_path, targets[style], "--prompts", str(path))
    assert [r["id"] for r in recs] == ["c0", "c1", "c2", "c3"]
    for msgs, rec in zip(convs, recs, strict=True):
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        want = _ids(tok.apply_chat_template(msgs[:last_user + 1], add_generation_prompt=True,
                                            tokenize=True))
        assert rec["prompt_ids"] == want
    # --prompt TEXT --chat: one user turn
    rec = _decode(tmp_path, targets[style], "--prompt", "Sort a list?", "--chat")[0]
    assert rec["prompt_ids"] == _ids(tok.apply_chat_template(
        [{"role": "user", "content": "Sort a list?"}], add_generation_prompt=True,
        tokenize=True))


def test_end_of_turn_stops_the_answer(targets, tmp_path, monkeypatch):
    """The random target never writes <|im_end|> by itself, so the end-of-turn token is
    taken to be the third token it writes: the chat run must stop right there, where the
    same prompt ids without chat run on."""
    target = targets["qwen3"]
    plain = _decode(tmp_path, target, "--prompt", "Hello there", "--chat",
                    "--ignore-eos")[0]
    stop = plain["output_ids"][2]
    first = plain["output_ids"].index(stop)
    monkeypatch.setattr(chat, "end_of_turn_ids", lambda tok: (stop,))
    rec = _decode(tmp_path, target, "--prompt", "Hello there", "--chat")[0]
    assert rec["output_ids"] == plain["output_ids"][:first + 1]
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps({"input_ids": plain["prompt_ids"]}) + "\n")
    raw = _decode(tmp_path, target, "--prompts", str(path))[0]  # not chat: no extra stop
    from specjax.models.config import ModelConfig

    eos = ModelConfig.from_dir(target).eos_token_ids
    want = plain["output_ids"]
    for i, t in enumerate(want):
        if t in eos:
            want = want[:i + 1]
            break
    assert raw["output_ids"] == want and stop not in eos


def test_real_end_of_turn_ids(targets):
    import transformers

    for style, eot in (("qwen3", "<|im_end|>"), ("llama3", "<|eot_id|>")):
        tok = transformers.AutoTokenizer.from_pretrained(targets[style])
        assert chat.end_of_turn_ids(tok) == (tok.convert_tokens_to_ids(eot),)


@pytest.mark.parametrize("args,needle", [
    (["--prompt", "hi", "--chat"], "chat needs a chat template"),
    (["--prompts", "CONV"], "chat needs a chat template"),
    (["--prompts", "BADROLE"], "unknown role"),
    (["--prompts", "NOUSER"], "user"),
])
def test_chat_errors_are_one_line(targets, tmp_path, capsys, args, needle):
    from specjax.decoding.loading import DEMO_DIR

    conv = tmp_path / "conv.jsonl"
    conv.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "hi"}]}) + "\n")
    nouser = tmp_path / "nouser.jsonl"
    nouser.write_text(json.dumps({"messages": [{"role": "system", "content": "x"}]}) + "\n")
    files = {"CONV": str(conv), "BADROLE": str(bad), "NOUSER": str(nouser)}
    args = [files.get(a, a) for a in args]
    target = f"{DEMO_DIR}/target" if needle.startswith("chat needs") else targets["qwen3"]
    out = tmp_path / "o.jsonl"
    rc = decode.main(["--target", target, "--drafter", "none", "--output", str(out), *args])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err
    assert not out.exists()
