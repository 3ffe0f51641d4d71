"""Measures every shipped demo drafter as decode.py measures it, and rewrites the
documents that quote the figures.

    python benchmarks/drafters.py [--only NAME ...] [--prompts N]   # measure (quiet machine)
    python benchmarks/drafters.py --render-only                     # documents from the JSON

The drafters: checkpoints/demo/drafters/{eagle3,block,kv1,hybrid}, the draft LM
checkpoints/demo/draft and the n-gram drafter. For each, one after another, this runs

    python decode.py --drafter DIR --show 0 --summary TMP.json [--prompts FIRST_N.jsonl]

(the 50 bundled prompts by default, 128 new tokens, EOS on, batch 1, T=0, f32 target, the
drafter's default G, autoregressive decoding interleaved in the same process; a fresh
process per drafter, the documented command itself rather than its session in this
process, as the other benchmarks build it through benchmarks/lib/sessions.py) and keeps
decode.py's summary whole (tokens/s, AR tokens/s, speedup, tau, alpha_k, ar_identical,
gamma, ...). Beside it, per drafter: its own parameter count (the elements of its
model.safetensors, read from the file's header), the first 12 hex digits of the file's
sha256, config.json's kind, and the held-out (simulated) tau of the exported weights:
the evaluation record in the drafter's train_metrics*.jsonl files whose step and tau
equal config.json's `train` record, which train.py writes when it exports the best-tau
snapshot (so the file and step are those the shipped weights came from, whichever
round). Per run: git commit (and the tracked files changed against it), date, python,
jax, jaxlib and flax versions, cores, load average before each drafter.

Results are merged into benchmarks/results/drafters.json (--only measures some drafters
and keeps the others' records) and written, with benchmarks/results/drafters.md and the
marked sections of the documents (`<!-- drafters:NAME -->` ... `<!-- /drafters:NAME -->`
in DOCS below; the prose around them is left alone), all or none after each drafter.
tests/benchmarks/test_drafters_bench.py checks that the committed documents equal what
--render-only makes of the committed JSON.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.lib.prompts import prompt_file  # noqa: E402
from benchmarks.lib.provenance import installed_environment as environment  # noqa: E402
from benchmarks.lib.provenance import sha256_prefix  # noqa: E402
from specjax import cli  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402

RESULTS = os.path.join("benchmarks", "results", "drafters.json")
PROMPTS = os.path.join("checkpoints", "demo", "prompts.jsonl")
COMMAND = "python benchmarks/drafters.py"
# name: decode.py's --drafter, the label in tables, extra decode.py flags (a --gamma only
# where a model card's headline uses another G than decode.py's default for the drafter).
DRAFTERS = {
    "eagle3": ("checkpoints/demo/drafters/eagle3", "`eagle3/` (default)", []),
    "block": ("checkpoints/demo/drafters/block", "`block/`", []),
    "kv1": ("checkpoints/demo/drafters/kv1", "`kv1/` (KVShot KV-only, 1 layer)", []),
    "hybrid": ("checkpoints/demo/drafters/hybrid", "`hybrid/` (hidden + KV)", []),
    "draft": ("checkpoints/demo/draft", "`../draft/` (draft LM)", []),
    "ngram": ("ngram", "n-gram (prompt lookup)", []),
}
# document (relative to the repository root): its marked sections
DOCS = {
    "checkpoints/demo/drafters/README.md": ["table"],
    "checkpoints/demo/drafters/eagle3/README.md": ["eagle3"],
    "checkpoints/demo/drafters/block/README.md": ["block"],
    "checkpoints/demo/drafters/kv1/README.md": ["kv1"],
    "checkpoints/demo/drafters/hybrid/README.md": ["hybrid"],
    "checkpoints/demo/README.md": ["draft"],
    "docs/kvshot.md": ["kvshot"],
    "README.md": ["eagle3", "table"],
}
KVSHOT_ROWS = {"eagle3": "eagle3 (hidden)", "kv1": "kv1 (KV, 1 layer)",
               "hybrid": "hybrid (hidden + KV, from eagle3)",
               "block": "block (hidden context, block-wise, DFlash2 selector + conv)"}
README_ORDER = ("eagle3", "kv1", "hybrid", "block")


def log(msg: str) -> None:
    print(f"[drafters] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the drafters' files

def count_params(path: str) -> int:
    """Elements of every tensor in a safetensors file, from its JSON header alone."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SpecjaxError(f"{path}: not a safetensors file (no header length)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise SpecjaxError(f"{path}: not a safetensors file (bad header)") from None
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def held_out(directory: str) -> dict | None:
    """The evaluation record the exported weights came from: the record of the
    directory's train_metrics*.jsonl files whose step and tau equal config.json's `train`
    record (train.py copies the best-tau record there at export). None for a directory
    without such a record (the draft LM)."""
    from specjax.fileio import read_config_json

    if not os.path.isfile(os.path.join(directory, "config.json")):
        return None
    train = read_config_json(directory, "drafter").get("train") or {}
    if "tau" not in train:
        return None
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("train_metrics") and name.endswith(".jsonl")):
            continue
        with open(os.path.join(directory, name)) as f:
            for line in f:
                r = json.loads(line) if line.strip() else {}
                if ("event" not in r and r.get("step") == train.get("step")
                        and r.get("tau") == train["tau"]):
                    return {"file": name, "step": r["step"], "tau": r["tau"],
                            "alpha": r.get("alpha"), "val_loss": r.get("val_loss")}
    return {"file": None, "step": train.get("step"), "tau": train["tau"],
            "alpha": train.get("alpha"), "val_loss": train.get("val_loss")}


def describe(name: str) -> dict:
    """The static part of a drafter's record: kind, own parameters, weights sha256
    prefix, held-out tau. Raises SpecjaxError for a missing drafter directory."""
    arg = DRAFTERS[name][0]
    if arg == "ngram":
        return {"kind": "ngram", "own_params": None, "weights_sha256": None,
                "held_out": None}
    d = os.path.join(ROOT, arg)
    weights = os.path.join(d, "model.safetensors")
    if not os.path.isfile(weights) or not os.path.isfile(os.path.join(d, "config.json")):
        raise SpecjaxError(f"{arg} has no model.safetensors or config.json")
    from specjax.fileio import read_config_json

    cfg = read_config_json(d, arg)
    kind = cfg.get("kind") or f"lm ({cfg.get('model_type', '?')})"
    return {"kind": kind, "own_params": count_params(weights),
            "weights_sha256": sha256_prefix(weights), "held_out": held_out(d)}


# ------------------------------------------------------------------ measurement

def measure(name: str, prompts: str | None, n_prompts: int | None, env: dict) -> dict:
    """One decode.py run of drafter `name`: its record (describe() plus the summary)."""
    arg, _, extra = DRAFTERS[name]
    record = {"drafter": arg, **describe(name)}
    shown = ["python", "decode.py", "--drafter", arg, "--show", "0", *extra]
    with tempfile.TemporaryDirectory(prefix="drafters-") as tmp:
        summary = os.path.join(tmp, "summary.json")
        cmd = [sys.executable, "decode.py", "--drafter", arg, "--show", "0", "--summary",
               summary, *extra] + (["--prompts", prompts] if prompts else [])
        load = os.getloadavg()
        start = datetime.datetime.now(datetime.UTC)
        t0 = time.monotonic()
        log(f"{name}: {' '.join(shown[1:])}{f' (first {n_prompts} prompts)' if prompts else ''}"
            f" (load average {load[0]:.2f})")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"decode.py failed for {name} (exit {proc.returncode}): {last}")
        with open(summary) as f:
            record["decode"] = json.load(f)
    record.update(command=" ".join(shown), measured_at=start.strftime("%Y-%m-%dT%H:%M:%SZ"),
                  run_s=round(wall, 1), load_average=[round(x, 2) for x in load], env=env)
    log(f"{name}: {record['decode']['speedup']:.2f}x, tau "
        f"{_f(record['decode'].get('tau'), '.3f')} in {wall:.0f} s")
    return record


# ------------------------------------------------------------------ rendering

def _f(x, spec=".2f", suffix="") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec) + suffix


def _params(n) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}M"


def _sha(r: dict) -> str:
    return f"`{r['weights_sha256']}`" if r.get("weights_sha256") else "-"


def _identical(d: dict) -> str:
    v = d.get("ar_identical")
    return "-" if v is None else ("yes" if v else "NO")


def _held(r: dict, with_source: bool = True) -> str:
    h = r.get("held_out")
    if not h:
        return "-"
    if not with_source:
        return f"{h['tau']:.3f}"
    src = f"`{h['file']}` step {h['step']:,}" if h.get("file") else f"step {h['step']:,}"
    return f"{h['tau']:.3f} ({src})"


def _code(env: dict) -> str:
    s = f"commit {env.get('commit') or 'unknown'}"
    n = len(env.get("changed_files") or [])
    return s + (f" with {n} uncommitted code file{'s' * (n != 1)}" if n else "")


def _gamma(d: dict) -> str:
    """The draft length a run used: "auto (mean 4.9)" under --gamma auto (decode.py's
    default for a drafter of one chain), else the fixed G."""
    sched = d.get("gamma_schedule")
    if not sched:
        return str(d.get("gamma"))
    ar = sched.get("autoregressive_batches") or 0
    fb = f", AR program {ar}/{sched.get('batches')}" if ar else ""
    return f"auto (mean {sched['mean_draft_length']:.1f}{fb})"


def _load(r: dict) -> str:
    la = r.get("load_average")
    return "" if not la else f", load average {la[0]:.2f} at the start"


def _prompts(d: dict) -> str:
    n = d.get("prompts")
    return "the 50 bundled prompts" if n == 50 else f"the first {n} bundled prompts"


def _provenance(records: dict) -> str:
    """Who measured what: date, code and prompts per group of drafters that share them."""
    groups: dict[tuple, list[str]] = {}
    for name, r in records.items():
        extra = "".join(f", {k}={v}" for k, v in (r["env"].get("env") or {}).items()
                        if k in ("GLIBC_TUNABLES", "XLA_FLAGS"))
        key = (r["measured_at"][:10], _code(r["env"]), _prompts(r["decode"]),
               f"jax {r['env'].get('jax')}", f"{r['env'].get('usable_cores')} cores{extra}")
        groups.setdefault(key, []).append(name)
    parts = []
    for (date, code, prompts, jax, cores), names in groups.items():
        who = "" if len(groups) == 1 else ", ".join(names) + ": "
        parts.append(f"{who}{date} UTC, {code}, {prompts}, {jax}, {cores}")
    return "; ".join(parts)


def _records(results: dict, names=None) -> dict:
    got = results.get("drafters") or {}
    return {n: got[n] for n in (names or DRAFTERS) if n in got}


def _missing(what: str, only: str = "") -> str:
    flag = f" --only {only}" if only else ""
    return (f"(not measured yet: `{COMMAND}{flag}` writes this {what} from "
            f"`{RESULTS}`)")


def table(results: dict) -> str:
    """The shipped-drafters table with its provenance line."""
    recs = _records(results)
    if not recs:
        return _missing("table")
    lines = ["| drafter | kind | own params | held-out tau (simulated) | decode.py tau | G "
             "| tokens/s | AR tokens/s | speedup | identical to AR | weights sha256 |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for name, r in recs.items():
        d = r["decode"]
        lines.append(
            f"| {DRAFTERS[name][1]} | {r['kind']} | {_params(r['own_params'])} | {_held(r)} "
            f"| {_f(d.get('tau'))} | {_gamma(d)} | {_f(d.get('tokens_per_s'), '.1f')} "
            f"| {_f(d.get('ar_tokens_per_s'), '.1f')} | {_f(d.get('speedup'), '.2f', 'x')} "
            f"| {_identical(d)} | {_sha(r)} |")
    lines += ["", f"`{COMMAND}` (`{RESULTS}`): each row is one `python decode.py --drafter "
              "DIR --show 0` run (G: the fixed draft length, or auto with its mean draft "
              "length where the run used --gamma auto, decode.py's default since "
              "2026-11-27; 128 new tokens, EOS on, batch 1, T=0, f32 target, "
              "autoregressive decoding interleaved batch by batch in the same run, so the "
              "speedup is a ratio within one run); " + _provenance(recs) + "."]
    return "\n".join(lines)


def headline(results: dict, name: str) -> str:
    """One line for a model card."""
    recs = _records(results, [name])
    if not recs:
        return _missing("line", name)
    r = recs[name]
    d = r["decode"]
    held = r.get("held_out")
    parts = [f"**{_f(d.get('speedup'), '.2f', 'x')}** over autoregressive decoding "
             f"({_f(d.get('tokens_per_s'), '.1f')} against "
             f"{_f(d.get('ar_tokens_per_s'), '.1f')} tokens/s), tau {_f(d.get('tau'), '.3f')}"
             f", outputs identical to AR: {_identical(d)}"]
    if held:
        parts.append(f"held-out tau {_held(r)}")
    if r.get("own_params") is not None:
        parts.append(f"{_params(r['own_params'])} own parameters")
    weights = f"weights sha256 {_sha(r)}, " if r.get("weights_sha256") else ""
    return (f"Measured by `{COMMAND}` ({r['measured_at'][:10]} UTC, {_code(r['env'])}, "
            f"{weights}`{r['command']}` on {_prompts(d)}, G {_gamma(d)}{_load(r)}): "
            + "; ".join(parts) + ".")


def kvshot_table(results: dict) -> str:
    recs = _records(results, list(KVSHOT_ROWS))
    if not recs:
        return _missing("table")
    lines = ["| drafter | own params | held-out tau (simulated) | decode.py tau (G) "
             "| f32 speedup | identical to AR | weights sha256 |",
             "|---|---:|---|---:|---:|---|---|"]
    for name, r in recs.items():
        d = r["decode"]
        lines.append(f"| {KVSHOT_ROWS[name]} | {_params(r['own_params'])} | {_held(r)} "
                     f"| {_f(d.get('tau'))} ({_gamma(d)}) "
                     f"| {_f(d.get('speedup'), '.2f', 'x')} | {_identical(d)} | {_sha(r)} |")
    lines += ["", f"`{COMMAND}` (`{RESULTS}`), each row one `python decode.py --drafter DIR "
              "--show 0` run, T=0: " + _provenance(recs) + "."]
    return "\n".join(lines)


def readme_line(results: dict) -> str:
    recs = _records(results, list(README_ORDER))
    if not recs:
        return _missing("line")
    cells = [f"{n} {_f(r['decode'].get('speedup'), '.2f', 'x')} (tau "
             f"{_f(r['decode'].get('tau'))}, held-out {_held(r, False)}, weights {_sha(r)})"
             for n, r in recs.items()]
    same = all(r["decode"].get("ar_identical") for r in recs.values())
    return (f"In decode.py (`{COMMAND}`, f32 target, T=0, each against its own interleaved "
            f"autoregressive run): " + ", ".join(cells)
            + ("; outputs identical to AR in every run" if same else "")
            + f"; {_provenance(recs)}. Every drafter: `benchmarks/results/drafters.md`.")


def report(results: dict) -> str:
    """benchmarks/results/drafters.md."""
    recs = _records(results)
    lines = ["# Shipped demo drafters, measured as decode.py measures them", "",
             f"Generated by `{COMMAND}` from `drafters.json`; do not edit by hand.", "",
             table(results), "", "| drafter | command | alpha_k in decode.py | measured "
             "| run s | load average before | uncommitted code files |",
             "|---|---|---|---|---:|---|---|"]
    for name, r in recs.items():
        d = r["decode"]
        alpha = " ".join(_f(a) for a in d.get("alpha") or []) or "-"
        lines.append(f"| {name} | `{r['command']}` | {alpha} | {r['measured_at']} "
                     f"| {r['run_s']:.0f} | {' '.join(f'{x:.2f}' for x in r['load_average'])} "
                     f"| {', '.join(r['env'].get('changed_files') or []) or '-'} |")
    return "\n".join(lines) + "\n"


SECTIONS = {"table": table, "kvshot": kvshot_table, "readme": readme_line,
            **{n: (lambda r, n=n: headline(r, n)) for n in DRAFTERS}}


def render_text(text: str, sections: list[str], results: dict, doc: str = "") -> str:
    """`text` with each named marked section replaced by its rendering (the indentation
    of the opening marker is kept on every line). Raises SpecjaxError when a section's
    markers are missing or repeated."""
    for key in sections:
        pat = re.compile(rf"^([ \t]*)<!-- drafters:{key} -->[ \t]*\n.*?"
                         rf"^[ \t]*<!-- /drafters:{key} -->[ \t]*$", re.S | re.M)
        found = pat.findall(text)
        if len(found) != 1:
            raise SpecjaxError(f"{doc or 'the document'} has {len(found)} "
                               f"`<!-- drafters:{key} -->` ... `<!-- /drafters:{key} -->` "
                               "sections, not 1")
        body = SECTIONS[key](results)

        def sub(m, body=body, key=key):
            ind = m.group(1)
            lines = [ind + x if x else x for x in body.split("\n")]
            return "\n".join([f"{ind}<!-- drafters:{key} -->", *lines,
                              f"{ind}<!-- /drafters:{key} -->"])

        text = pat.sub(sub, text)
    return text


def rendered(results: dict, docs_root: str) -> dict[str, str]:
    """{path: new text} for every document of DOCS under docs_root."""
    out = {}
    for rel, sections in DOCS.items():
        path = os.path.join(docs_root, rel)
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            raise SpecjaxError(f"{rel} not found under {docs_root}") from None
        out[path] = render_text(text, sections, results, rel)
    return out


def load_results(path: str) -> dict:
    if not os.path.exists(path):
        return {"drafters": {}}
    try:
        with open(path) as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        raise SpecjaxError(f"cannot read {path}: {e}") from None
    if not isinstance(results, dict) or not isinstance(results.get("drafters"), dict):
        raise SpecjaxError(f"{path} has no \"drafters\" object")
    return results


def stale(results: dict) -> list[str]:
    """Drafters whose weights on disk are not the ones their record was measured with."""
    out = []
    for name, r in _records(results).items():
        if r.get("weights_sha256") is None:
            continue
        path = os.path.join(ROOT, DRAFTERS[name][0], "model.safetensors")
        if not os.path.isfile(path) or sha256_prefix(path) != r["weights_sha256"]:
            out.append(name)
    return out


def write_all(results: dict, results_path: str, docs_root: str, with_json: bool) -> None:
    """The documents, drafters.md and (with_json) drafters.json, all or none."""
    from specjax.fileio import atomic_write_all

    items = []
    for path, text in rendered(results, docs_root).items():
        data = text.encode()
        items.append((path, lambda f, data=data: f.write(data)))
    if _records(results):
        md = report(results).encode()
        items.append((os.path.splitext(results_path)[0] + ".md", lambda f: f.write(md)))
    if with_json:
        js = (json.dumps(results, indent=1) + "\n").encode()
        items.append((results_path, lambda f: f.write(js)))
    os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
    atomic_write_all(items)


# ------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = cli.ArgumentParser(prog="drafters.py", description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=list(DRAFTERS), metavar="NAME",
                    help=f"measure these drafters only ({', '.join(DRAFTERS)}); the others' "
                         "records are kept")
    ap.add_argument("--prompts", type=int, default=None,
                    help="decode the first N bundled prompts (default: all 50, as decode.py)")
    ap.add_argument("--render-only", action="store_true",
                    help="measure nothing: rewrite the documents and drafters.md from the JSON")
    ap.add_argument("--results", default=os.path.join(ROOT, RESULTS),
                    help="the results JSON (drafters.md is written beside it)")
    ap.add_argument("--docs-root", default=ROOT,
                    help="directory that holds the documents (default: the repository; "
                         "tests render a copy)")
    args = ap.parse_args(argv)
    try:
        if args.render_only and (args.only or args.prompts is not None):
            raise SpecjaxError("--render-only measures nothing: drop --only and --prompts")
        if args.prompts is not None and args.prompts < 1:
            raise SpecjaxError(f"--prompts {args.prompts}: must be >= 1")
        results = load_results(args.results)
        if args.render_only:
            write_all(results, args.results, args.docs_root, with_json=False)
            for name in stale(results):
                log(f"warning: {name}'s weights changed since they were measured; "
                    f"run `{COMMAND} --only {name}`")
            log(f"rendered {len(DOCS)} documents from {args.results}")
            return 0
        names = [n for n in DRAFTERS if not args.only or n in args.only]
        for name in names:  # a missing directory fails before any measurement
            describe(name)
        rendered(results, args.docs_root)  # and so does a document without its markers
        prompts = prompt_file(args.prompts, os.path.join(ROOT, PROMPTS)) \
            if args.prompts is not None else None
    except SpecjaxError as e:
        print(f"drafters.py: error: {e}", file=sys.stderr)
        return 2
    env = environment()
    try:
        for name in names:
            results.setdefault("drafters", {})[name] = measure(name, prompts, args.prompts,
                                                               env)
            results["drafters"] = _records(results)  # DRAFTERS' order
            write_all(results, args.results, args.docs_root, with_json=True)
    except RuntimeError as e:
        print(f"drafters.py: error: {e}", file=sys.stderr)
        return 1
    finally:
        if prompts:
            os.unlink(prompts)
    log(f"wrote {args.results}, its .md and {len(DOCS)} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
