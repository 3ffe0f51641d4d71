"""specjax.data.chat and specjax.prepare: ids equal to transformers' apply_chat_template,
loss masks on exactly the assistant turns (checked against spans found from the known
structure of the real Qwen3 and Llama-3.1 templates, not by the implementation's prefix
rendering), conversation reading with line-numbered errors, and the prepare CLI."""

import copy
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from specjax.data import chat
from specjax.errors import SpecjaxError
from specjax.testing.chat import (
    LLAMA3_TEMPLATE,
    QWEN3_TEMPLATE,
    make_chat_target,
    make_chat_tokenizer,
    sample_conversations,
    write_conversations,
)
from specjax.tools.prepare import main as prepare_main

STYLES = ("qwen3", "llama3")


@pytest.fixture(scope="module")
def toks():
    return {s: make_chat_tokenizer(s) for s in STYLES}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_chat_target(str(tmp_path_factory.mktemp("chat") / "target"), "qwen3")


def _ids(result):
    return list(result["input_ids"]) if hasattr(result, "keys") else list(result)


# ---- an independent reference for the mask -------------------------------------------

def _assistant_renders(style, messages):
    """(header, body, close) of each assistant turn as the real template writes it."""
    out = []
    if style == "qwen3":
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            body = m["content"]
            if i > last_user and i == len(messages) - 1:  # Qwen3's think block, last turn
                body = "<think>\n\n</think>\n\n" + body.lstrip("\n")
            out.append(("<|im_start|>assistant\n", body, "<|im_end|>"))
    else:
        for m in messages:
            if m["role"] == "assistant":
                out.append(("<|start_header_id|>assistant<|end_header_id|>\n\n",
                            m["content"].strip(), "<|eot_id|>"))
    return out


def expected_mask(style, tok, messages):
    """1 on tokens overlapping each assistant turn's body + end-of-turn text, where the
    turns are found by searching the rendered text for header + body + close in order."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for header, body, close in _assistant_renders(style, messages):
        at = text.find(header + body + close, cursor)
        assert at >= 0, (header + body + close, text)
        start = at + len(header)
        cursor = start + len(body) + len(close)
        spans.append((start, cursor))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return [int(any(s < b and e > a for a, b in spans)) for s, e in enc["offset_mapping"]]


def masked_runs_text(tok, ids, mask):
    runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def check_mask(style, tok, messages, ids, mask):
    """True when `mask` is exactly the assistant tokens (span reference and decoded runs)."""
    if mask != expected_mask(style, tok, messages):
        return False
    want = [body + close for _, body, close in _assistant_renders(style, messages)]
    return masked_runs_text(tok, ids, mask) == want


CASES = {
    "system": [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "What is a list?"},
               {"role": "assistant", "content": "A mutable sequence."}],
    "multi": [{"role": "user", "content": "Hi there."},
              {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": "Sort a list."},
              {"role": "assistant", "content": "Call sorted(xs) or xs.sort()."},
              {"role": "user", "content": "Thanks."},
              {"role": "assistant", "content": "You are welcome."}],
    "whitespace": [{"role": "system", "content": "  padded system  "},
                   {"role": "user", "content": "\nq1\n"},
                   {"role": "assistant", "content": "\n  first answer \n\n"},
                   {"role": "user", "content": "q2"},
                   {"role": "assistant", "content": "\n\nsecond  answer\t \n"}],
    "ends_with_user": [{"role": "user", "content": "a"},
                       {"role": "assistant", "content": "b c d"},
                       {"role": "user", "content": "e"}],
    "unicode": [{"role": "user", "content": "café?"},
                {"role": "assistant", "content": "東京 naïve ✓"}],
}


@pytest.mark.parametrize("style", STYLES)
def test_prompt_and_conversation_ids_equal_transformers(toks, style):
    tok = toks[style]
    for msgs in [*CASES.values(), *sample_conversations(8, 1)]:
        want = _ids(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        assert chat.prompt_ids(tok, msgs) == want
        ids, mask = chat.conversation_ids_and_mask(tok, msgs)
        assert ids == _ids(tok.apply_chat_template(msgs, tokenize=True))
        assert len(mask) == len(ids) and set(mask) <= {0, 1}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_mask_is_exactly_the_assistant_turns(toks, style, case):
    tok = toks[style]
    msgs = CASES[case]
    ids, mask = chat.conversation_ids_and_mask(tok, msgs)
    assert check_mask(style, tok, msgs, ids, mask), masked_runs_text(tok, ids, mask)
    eot = chat.end_of_turn_ids(tok)
    n_turns = sum(m["role"] == "assistant" for m in msgs)
    assert sum(ids[k] in eot and mask[k] for k in range(len(ids))) == n_turns
    if style == "llama3":
        assert ids[0] == tok.bos_token_id and mask[0] == 0


@pytest.mark.parametrize("style", STYLES)
def test_mask_on_sample_conversations(toks, style):
    tok = toks[style]
    for msgs in sample_conversations(12, 3):
        ids, mask = chat.conversation_ids_and_mask(tok, msgs)
        assert check_mask(style, tok, msgs, ids, mask)


def test_qwen3_last_turn_masks_the_think_block_and_not_the_header(toks):
    tok = toks["qwen3"]
    ids, mask = chat.conversation_ids_and_mask(tok, CASES["system"])
    runs = masked_runs_text(tok, ids, mask)
    assert runs == ["<think>\n\n</think>\n\nA mutable sequence.<|im_end|>"]
    # the "\n" after <|im_end|> closes the text and is not masked
    assert tok.decode(ids[-1:]) == "\n" and mask[-1] == 0


def test_a_shifted_mask_fails_the_check(toks):
    for style in STYLES:
        tok = toks[style]
        for msgs in (CASES["multi"], CASES["whitespace"]):
            ids, mask = chat.conversation_ids_and_mask(tok, msgs)
            assert check_mask(style, tok, msgs, ids, mask)
            for shifted in (mask[1:] + [0], [0] + mask[:-1]):
                assert not check_mask(style, tok, msgs, ids, shifted)


def test_no_assistant_turn_gives_a_zero_mask(toks):
    for tok in toks.values():
        ids, mask = chat.conversation_ids_and_mask(tok, [{"role": "user", "content": "hi"}])
        assert ids and not any(mask)


def test_end_of_turn_ids_and_until_last_user(toks):
    assert chat.end_of_turn_ids(toks["qwen3"]) == (toks["qwen3"].convert_tokens_to_ids("<|im_end|>"),)
    assert chat.end_of_turn_ids(toks["llama3"]) == (toks["llama3"].convert_tokens_to_ids("<|eot_id|>"),)
    msgs = CASES["multi"]
    assert chat.messages_until_last_user(msgs) == msgs[:5]
    assert chat.messages_until_last_user(CASES["ends_with_user"]) == CASES["ends_with_user"]
    with pytest.raises(SpecjaxError, match="no user turn"):
        chat.messages_until_last_user([{"role": "system", "content": "x"}])


def test_fixture_templates_are_the_released_ones():
    # spot checks of the copied text (the tests above exercise the rendering)
    assert "ns.last_query_index" in QWEN3_TEMPLATE and "'<think>\\n\\n</think>\\n\\n'" in QWEN3_TEMPLATE
    assert LLAMA3_TEMPLATE.startswith("{{- bos_token }}")
    assert '{%- set date_string = "26 Jul 2024" %}' in LLAMA3_TEMPLATE


def test_generation_block_templates_use_the_assistant_mask(toks):
    tok = copy.deepcopy(toks["qwen3"])
    plain = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
             "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
             "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs = CASES["multi"]
    tok.chat_template = plain
    ids, mask = chat.conversation_ids_and_mask(tok, msgs)
    # the block leaves <|im_end|> out; it is added, so the runs match the prefix method's
    assert masked_runs_text(tok, ids, mask) == [
        m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]
    tok.chat_template = plain.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert chat.conversation_ids_and_mask(tok, msgs) == (ids, mask)


def test_template_errors(toks, tmp_path):
    tok = copy.deepcopy(toks["qwen3"])
    tok.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>"
                         "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(SpecjaxError, match="prefixes consistently.*turn 1"):
        chat.conversation_ids_and_mask(tok, CASES["multi"])
    tok.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(SpecjaxError, match="not a special token"):
        chat.end_of_turn_ids(tok)
    tok.chat_template = "{{ raise_exception('no way') }}"
    with pytest.raises(SpecjaxError, match="cannot render.*no way"):
        chat.prompt_ids(tok, CASES["multi"])
    tok.chat_template = "{% if false %}x{% endif %}"
    with pytest.raises(SpecjaxError, match="no tokens"):
        chat.conversation_ids_and_mask(tok, CASES["multi"])


def test_load_chat_tokenizer(toks, tmp_path, target):
    tok = chat.load_chat_tokenizer(target)
    assert chat.has_chat_template(tok) and tok.chat_template == QWEN3_TEMPLATE
    assert chat.prompt_ids(tok, CASES["multi"]) == chat.prompt_ids(toks["qwen3"], CASES["multi"])
    plain = copy.deepcopy(toks["qwen3"])
    plain.chat_template = None
    assert not chat.has_chat_template(plain)
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(SpecjaxError, match="no chat template") as e:
        chat.load_chat_tokenizer(str(tmp_path / "plain"))
    assert "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecjaxError, match="no readable tokenizer"):
        chat.load_chat_tokenizer(str(tmp_path / "empty"))
    with pytest.raises(SpecjaxError, match="does not exist"):
        chat.load_chat_tokenizer(str(tmp_path / "missing"))


# ---- reading conversations ------------------------------------------------------------

def test_read_conversations_both_formats_agree(tmp_path):
    a = chat.read_conversations(write_conversations(str(tmp_path / "a.jsonl"), "openai", 6, 0))
    b = chat.read_conversations(write_conversations(str(tmp_path / "b.jsonl"), "sharegpt", 6, 0))
    assert [c["messages"] for c in a] == [c["messages"] for c in b] == sample_conversations(6, 0)
    assert [c["id"] for c in a] == [f"c{i}" for i in range(6)]
    assert [c["line"] for c in b] == list(range(1, 7))
    assert {c["format"] for c in a} == {"openai"} and {c["format"] for c in b} == {"sharegpt"}


def test_read_conversations_bom_blank_lines_default_ids(tmp_path):
    p = tmp_path / "c.jsonl"
    lines = [json.dumps({"conversations": [{"from": "human", "value": "q"},
                                           {"from": "chatgpt", "value": "a"}]}),
             "", "   ",
             json.dumps({"id": 7, "messages": [{"role": "user", "content": "q2"}]})]
    p.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    got = chat.read_conversations(str(p))
    assert [(c["id"], c["line"]) for c in got] == [("0", 1), ("7", 4)]
    assert got[0]["messages"] == [{"role": "user", "content": "q"},
                                  {"role": "assistant", "content": "a"}]


GOOD = json.dumps({"messages": [{"role": "user", "content": "q"},
                                {"role": "assistant", "content": "a"}]})
BAD = {
    "not JSON": "{oops",
    "expected a JSON object": "[1, 2]",
    "neither": json.dumps({"text": "hello"}),
    "unknown role 'tool'": json.dumps({"messages": [{"role": "tool", "content": "x"}]}),
    "unknown from 'robot'": json.dumps({"conversations": [{"from": "robot", "value": "x"}]}),
    "content must be a string": json.dumps({"messages": [{"role": "user", "content": None}]}),
    "value must be a string": json.dumps({"conversations": [{"from": "gpt", "value": [1]}]}),
    "empty conversation": json.dumps({"messages": []}),
    "only the first": json.dumps({"messages": [{"role": "user", "content": "q"},
                                               {"role": "system", "content": "s"}]}),
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_read_conversations_bad_lines_name_the_line(tmp_path, what):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join([GOOD, "", BAD[what], GOOD]) + "\n")
    with pytest.raises(SpecjaxError, match=f"bad.jsonl line 3: .*{what}") as e:
        chat.read_conversations(str(p))
    assert "\n" not in str(e.value)


def test_read_conversations_file_errors(tmp_path):
    with pytest.raises(SpecjaxError, match="cannot be read"):
        chat.read_conversations(str(tmp_path / "missing.jsonl"))
    (tmp_path / "blank.jsonl").write_text("\n \n")
    with pytest.raises(SpecjaxError, match="no conversations"):
        chat.read_conversations(str(tmp_path / "blank.jsonl"))
    (tmp_path / "latin.jsonl").write_bytes(GOOD.encode() + b"\n\xe9\n")
    with pytest.raises(SpecjaxError, match="line 2: not UTF-8"):
        chat.read_conversations(str(tmp_path / "latin.jsonl"))


# ---- specjax.prepare ------------------------------------------------------------------

def _run(capsys, *args):
    rc = prepare_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_prepare_end_to_end(tmp_path, target, capsys):
    data = write_conversations(str(tmp_path / "c.jsonl"), "sharegpt", 12, 0)
    out = tmp_path / "out"
    rc, stdout, err = _run(capsys, "--target", target, "--data", data, "--out", out)
    assert rc == 0, err
    assert stdout.startswith("train: 12 conversations") and len(stdout.splitlines()) == 1
    assert sorted(os.listdir(out)) == ["loss_mask.npy", "manifest.json", "tokens.npy"]
    toks, mask = np.load(out / "tokens.npy"), np.load(out / "loss_mask.npy")
    assert toks.dtype == np.uint16 and mask.dtype == np.uint8 and toks.shape == mask.shape
    tok = chat.load_chat_tokenizer(target)
    ref_ids, ref_mask = [], []
    for c in chat.read_conversations(data):
        i, m = chat.conversation_ids_and_mask(tok, c["messages"])
        ref_ids += i
        ref_mask += m
    assert toks.tolist() == ref_ids and mask.tolist() == ref_mask
    man = json.loads((out / "manifest.json").read_text())
    assert man["splits"] == {"train": {"conversations": 12, "tokens": len(ref_ids),
                                       "assistant_tokens": int(sum(ref_mask))}}
    assert man["formats"] == {"sharegpt": 12} and man["truncated"] == 0
    assert man["end_of_turn_ids"] == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert man["end_of_turn_ids"][0] in man["eos_token_ids"]
    assert man["target"] == os.path.abspath(target)
    # a second run into the same directory is refused and leaves it as it was
    rc, _, err = _run(capsys, "--target", target, "--data", data, "--out", out)
    assert rc == 2 and "earlier specjax.prepare output" in err
    assert sorted(os.listdir(out)) == ["loss_mask.npy", "manifest.json", "tokens.npy"]


def test_prepare_val_split_keeps_whole_conversations(tmp_path, target, capsys):
    data = write_conversations(str(tmp_path / "c.jsonl"), "openai", 12, 1)
    out = tmp_path / "out"
    rc, stdout, err = _run(capsys, "--target", target, "--data", data, "--out", out,
                           "--val-fraction", "0.25", "--seed", "3")
    assert rc == 0, err
    assert len(stdout.splitlines()) == 2 and "val: 3 conversations" in stdout
    tok = chat.load_chat_tokenizer(target)
    convs = [chat.conversation_ids_and_mask(tok, c["messages"])
             for c in chat.read_conversations(data)]
    streams = {s: (np.load(out / f"{p}tokens.npy").tolist(),
                   np.load(out / f"{p}loss_mask.npy").tolist())
               for s, p in (("train", ""), ("val", "val_"))}
    cursor, taken = {"train": 0, "val": 0}, {"train": 0, "val": 0}
    for ids, mask in convs:  # each conversation, in order, whole in exactly one split
        hits = [s for s in streams
                if streams[s][0][cursor[s]:cursor[s] + len(ids)] == ids
                and streams[s][1][cursor[s]:cursor[s] + len(ids)] == mask]
        assert len(hits) >= 1
        cursor[hits[0]] += len(ids)
        taken[hits[0]] += 1
    assert cursor == {s: len(streams[s][0]) for s in streams}
    assert taken == {"train": 9, "val": 3}
    man = json.loads((out / "manifest.json").read_text())
    assert man["splits"]["val"]["conversations"] == 3
    assert man["splits"]["val"]["tokens"] == len(streams["val"][0])


def test_prepare_max_length_cuts_conversations(tmp_path, target, capsys):
    data = write_conversations(str(tmp_path / "c.jsonl"), "openai", 6, 0)
    out = tmp_path / "out"
    rc, _, err = _run(capsys, "--target", target, "--data", data, "--out", out,
                      "--max-length", "40")
    assert rc == 0, err
    man = json.loads((out / "manifest.json").read_text())
    tok = chat.load_chat_tokenizer(target)
    lens = [len(chat.conversation_ids_and_mask(tok, c["messages"])[0])
            for c in chat.read_conversations(data)]
    assert man["truncated"] == sum(n > 40 for n in lens) > 0
    assert man["splits"]["train"]["tokens"] == sum(min(n, 40) for n in lens)


def _bad_run(capsys, tmp_path, target, lines, match, *extra):
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    before = sorted(os.listdir(tmp_path))
    rc, out, err = _run(capsys, "--target", target, "--data", data, "--out",
                        tmp_path / "out", *extra)
    assert rc == 2 and out == ""
    assert err.startswith("specjax.prepare: error: ") and err.count("\n") == 1, err
    assert match in err, err
    assert sorted(os.listdir(tmp_path)) == before  # no output, no temporary directory


def test_prepare_bad_data_writes_nothing(tmp_path, target, capsys):
    _bad_run(capsys, tmp_path, target, [GOOD, GOOD, BAD["neither"]], "bad.jsonl line 3")
    _bad_run(capsys, tmp_path, target,
             [GOOD, json.dumps({"messages": [{"role": "user", "content": "q"}]})],
             "line 2: no assistant turn")
    _bad_run(capsys, tmp_path, target, [GOOD], "needs at least 2 conversations",
             "--val-fraction", "0.5")


def test_prepare_refuses_existing_output_and_bad_flags(tmp_path, target, capsys):
    data = write_conversations(str(tmp_path / "c.jsonl"), "openai", 3, 0)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    rc, _, err = _run(capsys, "--target", target, "--data", data, "--out", tmp_path / "full")
    assert rc == 2 and "is not empty" in err
    (tmp_path / "file").write_text("x")
    rc, _, err = _run(capsys, "--target", target, "--data", data, "--out", tmp_path / "file")
    assert rc == 2 and "not a directory" in err
    rc, _, err = _run(capsys, "--target", target, "--data", data, "--out", tmp_path / "o",
                      "--val-fraction", "1")
    assert rc == 2 and "--val-fraction" in err and not (tmp_path / "o").exists()
    (tmp_path / "empty").mkdir()  # an empty directory is fine
    rc, _, err = _run(capsys, "--target", target, "--data", data, "--out", tmp_path / "empty")
    assert rc == 0, err


def test_prepare_checks_ids_against_the_vocab(tmp_path, target, capsys):
    small = tmp_path / "small"
    shutil.copytree(target, small)
    cfg = json.loads((small / "config.json").read_text())
    cfg["vocab_size"] = 300
    (small / "config.json").write_text(json.dumps(cfg))
    _bad_run(capsys, tmp_path, str(small), [GOOD], ">= the target's vocab_size 300")


def test_prepare_runs_as_a_module(tmp_path, target):
    data = write_conversations(str(tmp_path / "c.jsonl"), "openai", 4, 0)
    r = subprocess.run([sys.executable, "-m", "specjax.prepare", "--target", target,
                        "--data", data, "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("train: 4 conversations")
    r = subprocess.run([sys.executable, "-m", "specjax.prepare", "--target", target,
                        "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "specjax.prepare", "--target", target,
                        "--data", data, "--out", str(tmp_path / "q"), "--no-such-flag"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "q").exists()
    assert r.stderr == ("specjax.prepare: error: unrecognized arguments: --no-such-flag "
                        "(see --help)\n")
