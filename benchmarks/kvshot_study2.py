"""The redone KVShot study's measurements and report (issue 29, section 2): every finished
run of the matrix (configs/study2/, runs/study2/NAME-sSEED, benchmarks/kvshot_runs.py)
measured on the same held-out sequences and prompts, with paired bootstrap intervals.

    python benchmarks/kvshot_study2.py measure [--only NAME ...] [--seeds S ...] [--prompts N]
                                               [--force]
    python benchmarks/kvshot_study2.py report  # docs/kvshot2.md + docs/img/kvshot2_*.png

`measure` opens only finished runs (drafter/config.json exists; a run still training is
never read) and skips runs already measured unless --force. Per run it writes
benchmarks/results/kvshot2/NAME-sSEED.json with, per held-out sequence or prompt:

1. simulated acceptance: the trainer's own validation loss (DrafterTrainer.loss_and_stats,
   evaluation=True: TTT unrolls every position; block-wise draws `num_anchors` blocks with
   a fixed key per sequence) on the sequences at positions SIM_START .. SIM_START+n of the
   held-out stream's order (benchmarks/data/study2/val.npy, data.seed 0). Positions
   0 .. 63 are the ones training validated on and picked its best-tau export by, so they
   are left out. Per sequence: accepted[k] (chains whose drafts 0..k all match the target's
   argmax), chains, correct[k] (draft k right on its own), and the hybrid's gate sum.
2. in-loop acceptance and speed: decode.py's engines, built as a decoding session
   (`benchmarks.lib.sessions`; target f32, the drafter's default bf16 matmuls, its draft vocabulary, kernels auto,
   batch 1, EOS on), on prompts cut from the held-out documents of val.npy (the first
   `prompt_tokens` tokens of evenly spaced documents; documents end at EOS), T = 0 and
   T = 1 with block verification (and token verification with --settings), each prompt
   run by the drafter and then by
   autoregressive decoding in the same process with the same key (decode.py's
   interleaving). Per prompt: new tokens, verification steps, accepted[k], wall seconds of
   both, and whether the T = 0 outputs are identical.
3. probes: for hybrid runs the same two measurements with the KV branch zeroed through the
   weights (gate_d = 0, so h = n: exactly EAGLE-3 on the hybrid's own weights,
   specjax/drafters/hybrid.py); for drafters with a KV memory (kv, block with kv context)
   the query cosine and the gradient share at random init and at the trained weights
   (benchmarks/kvshot_probes.py).

`report` reads only those JSON files and renders docs/kvshot2.md (the whole file is
generated) and its plots; runs without results are listed as missing and their rows say
"not yet measured". Intervals: `bootstrap_ci`, a crossed bootstrap over seeds and prompts.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # this checkout's specjax first (an installed copy may differ)

from benchmarks.kvshot_runs import MATRIX, MATRIX_CONFIG_DIR, MATRIX_ROOT, SEEDS  # noqa: E402
from specjax import cli  # noqa: E402

RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results", "kvshot2")
DOC = os.path.join(ROOT, "docs", "kvshot2.md")
IMG_DIR = os.path.join(ROOT, "docs", "img")
VAL_NPY = os.path.join(ROOT, "benchmarks", "data", "study2", "val.npy")

# Sizes of one run's measurement (about 3-6 minutes on 2 busy CPU cores for the demo
# target; the report states the sizes it was given).
SIZES = {"sim_start": 64, "sim_rows": 96, "prompts": 32, "prompt_tokens": 96,
         "new_tokens": 96}
SIM_KEY = 2  # block-wise anchors of sequence i: fold_in(PRNGKey(SIM_KEY), i), every run
DECODE_SEED = 0  # prompt i samples with fold_in(key(DECODE_SEED), i), as decode.py --seed 0
# in-loop settings: name -> (temperature, verification)
SETTINGS = {"t0": (0.0, "block"), "t1_token": (1.0, "token"), "t1_block": (1.0, "block")}
DEFAULT_SETTINGS = ("t0", "t1_block")  # t1_token on request (--settings): ~100 s more a run
ABLATED = {"t0": "t0_nokv", "t1_block": "t1_block_nokv"}  # hybrid: the same, KV branch off
LABELS = {"eagle3": "eagle3 (hidden, TTT)", "kv2": "kv2 (KV-only, 2 layers, TTT)",
          "block_kv": "block_kv (block, KV context, block-wise)",
          "block_hidden": "block_hidden (block, hidden context, block-wise)",
          "hybrid_from_eagle3": "hybrid_from_eagle3 (TTT, from eagle3)",
          "eagle3_more": "eagle3_more (eagle3 + the hybrid's extra steps)"}
RESAMPLES = 4000
LEVEL = 0.95
BOOT_SEED = 0


def log(msg: str) -> None:
    print(f"[kvshot2] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ statistics

def bootstrap_ci(arrays: dict[str, np.ndarray], stat, *, resamples: int = RESAMPLES,
                 level: float = LEVEL, seed: int = BOOT_SEED) -> dict:
    """Percentile interval of a statistic of totals, by a crossed (two-way) bootstrap over
    seeds and prompts.

    Args:
      arrays: name -> f64[S, P]: one value per (seed, prompt) cell, e.g. accepted drafts and
        verification steps per prompt; every array over the same S seeds and P prompts. To
        compare two drafters, pass both drafters' arrays: they are paired (resampled with
        the same seed indices and the same prompts).
      stat: f(totals) -> f64[...]: the statistic from totals, name -> f64[...] (sums over
        the cells, each cell counted as often as its seed and its prompt were drawn), e.g.
        tau = 1 + totals["accepted"] / totals["steps"]. Called once on the full data
        (scalars) and once on all resamples (f64[R]).
      resamples: R; level: the interval's coverage; seed: the resampling's numpy seed.
    Each resample draws S seed indices and P prompt indices with replacement, independently
    (seeds and prompts are crossed: every seed ran every prompt), so both the spread between
    seeds and the spread between prompts enter the interval; with S = 1 only the prompts'.
    Returns: {"estimate", "lo", "hi", "seeds": S, "prompts": P, "resamples": R} (lo/hi NaN
      where no resample has a finite statistic).
    """
    names = list(arrays)
    xs = {k: np.asarray(arrays[k], np.float64) for k in names}
    shapes = {x.shape for x in xs.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"arrays must all be [S, P], got {sorted(shapes)}")
    S, P = next(iter(shapes))
    rng = np.random.default_rng(seed)
    cs = rng.multinomial(S, np.full(S, 1.0 / S), size=resamples).astype(np.float64)  # [R,S]
    cp = rng.multinomial(P, np.full(P, 1.0 / P), size=resamples).astype(np.float64)  # [R,P]
    with np.errstate(divide="ignore", invalid="ignore"):
        est = float(stat({k: x.sum() for k, x in xs.items()}))
        vals = np.asarray(stat({k: ((cs @ x) * cp).sum(axis=1) for k, x in xs.items()}),
                          np.float64)
    vals = vals[np.isfinite(vals)]
    tail = (1.0 - level) / 2 * 100
    lo, hi = (np.percentile(vals, [tail, 100 - tail]) if len(vals) else (math.nan, math.nan))
    return {"estimate": est, "lo": float(lo), "hi": float(hi), "seeds": int(S),
            "prompts": int(P), "resamples": int(resamples)}


def ratio(num: str, den: str, offset: float = 0.0):
    """stat for `bootstrap_ci`: offset + totals[num] / totals[den]."""
    return lambda t: offset + t[num] / t[den]


def speed_ratio(t):
    """stat for `bootstrap_ci`: (tokens / wall) / (AR tokens / AR wall) over the totals."""
    return (t["tokens"] / t["wall"]) / (t["ar_tokens"] / t["ar_wall"])


def difference(stat_a, stat_b):
    """stat of a paired difference: arrays of drafter a prefixed "a.", of b "b."."""
    def f(t):
        ta = {k[2:]: v for k, v in t.items() if k.startswith("a.")}
        tb = {k[2:]: v for k, v in t.items() if k.startswith("b.")}
        return stat_a(ta) - stat_b(tb)
    return f


# ------------------------------------------------------------------ runs and provenance

def run_dir(name: str, seed: int, runs_root: str = MATRIX_ROOT) -> str:
    """RUNS_ROOT/NAME-sSEED."""
    return os.path.join(runs_root, f"{name}-s{seed}")


def is_finished(name: str, seed: int, runs_root: str = MATRIX_ROOT) -> bool:
    """True once the run exported its drafter (drafter/config.json exists)."""
    return os.path.isfile(os.path.join(run_dir(name, seed, runs_root), "drafter",
                                       "config.json"))


def result_path(name: str, seed: int, results_dir: str = RESULTS_DIR) -> str:
    """RESULTS_DIR/NAME-sSEED.json."""
    return os.path.join(results_dir, f"{name}-s{seed}.json")


def git_state() -> dict:
    """{"rev": HEAD's short hash, "dirty": tracked files under specjax/, decode.py and
    benchmarks/ that differ from HEAD (the code measured is HEAD plus these)}."""
    def git(*a):
        try:  # not stripped: porcelain lines start with a space when the index is clean
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "specjax", "decode.py",
                "benchmarks")
    return {"rev": git("rev-parse", "--short=12", "HEAD").strip() or None,
            "dirty": sorted(line[3:] for line in dirty.splitlines())}


def machine() -> dict:
    """The measuring machine: CPU model, cores, load average, jax version and backend."""
    import jax

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg": list(os.getloadavg()),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "python": platform.python_version()}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def training_record(rdir: str) -> dict:
    """From RUN/metrics.jsonl and RUN/drafter/config.json: {"params", "tokens_per_s",
    "evals": [{"step", "tau", "gate"?}], "best": the export's train record}."""
    from specjax.fileio import read_config_json

    evals, params, rate = [], None, None
    path = os.path.join(rdir, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("event") in ("start", "resume") and r.get("params"):
                    params = r["params"]
                if r.get("event") == "done" and r.get("tokens_per_s"):
                    rate = r["tokens_per_s"]
                if "tau" in r and "event" not in r:
                    evals.append({k: r[k] for k in ("step", "tau", "gate") if k in r})
    best = read_config_json(os.path.join(rdir, "drafter"), "drafter").get("train") or {}
    return {"params": params, "tokens_per_s": rate, "evals": evals,
            "best": {k: best[k] for k in ("step", "tau", "alpha", "acc", "gate", "val_loss")
                     if k in best}}


# ------------------------------------------------------------------ measurements

def load_config_for(name: str, seed: int, *, runs_root: str = MATRIX_ROOT,
                    config_dir: str = MATRIX_CONFIG_DIR, overrides=()):
    """The TrainConfig of run NAME-sSEED: CONFIG_DIR/NAME.yaml with train.seed = SEED,
    run_dir RUNS_ROOT/NAME-sSEED and `overrides` ("dotted.key=value")."""
    from specjax.train import load_config

    return load_config(os.path.join(config_dir, f"{name}.yaml"),
                       [f"train.seed={seed}", *overrides],
                       run_dir=run_dir(name, seed, runs_root))


def zero_kv_branch(params):
    """A copy of hybrid drafter params (a trainer's nnx.State, or decode params {"net":
    ...}) with every gate_d leaf zeroed: the gate's output h = n + g * gate_d (o - n) is
    then n, the EAGLE-3 path alone (specjax/drafters/hybrid.py). Raises ValueError when
    there is no gate_d (not a hybrid)."""
    import jax
    import jax.numpy as jnp

    hits = []

    def f(path, x):
        if "gate_d" in jax.tree_util.keystr(path):
            hits.append(path)
            return jnp.zeros_like(x)
        return x

    out = jax.tree_util.tree_map_with_path(f, params)
    if not hits:
        raise ValueError("no gate_d in these params: not a hybrid drafter")
    return out


def simulated(run, params, start: int, rows: int, key_seed: int = SIM_KEY,
              chunk: int = 8) -> dict:
    """Per held-out sequence, the trainer's own validation statistics.

    Args:
      run: a DrafterRun (`kvshot_probes.run_of_config`); params: the drafter's weights
        (like run.trainer.abstract_state.params).
      start, rows: the sequences at positions start .. start+rows-1 of the held-out
        stream's order (run.data.val), each evaluated alone, as a batch of one, by
        DrafterTrainer.loss_and_stats(evaluation=True) under jit (vmapped over `chunk`
        sequences) with key fold_in(PRNGKey(key_seed), position).
    Returns: {"sequence_ids": [rows] ids in the stream, "accepted": [rows][G],
      "chains": [rows], "correct": [rows][G], "gate"/"gate_count": [rows] (hybrid)}.
    """
    import jax

    tr = run.trainer
    data, _ = run.data.val.batch(start, rows)
    ids = run.data.val.sequence_ids(start, rows)
    pos = np.arange(start, start + rows)

    def one(p, row, index, target_params):
        key = jax.random.fold_in(jax.random.PRNGKey(key_seed), index)
        return tr.loss_and_stats(p, row[None], target_params, key, evaluation=True)[1]

    fn = jax.jit(jax.vmap(one, in_axes=(None, 0, 0, None)))
    got: dict[str, list] = {}
    for i in range(0, rows, chunk):
        n = min(chunk, rows - i)
        take = np.r_[np.arange(i, i + n), np.full(chunk - n, i)]  # pad: one compiled shape
        st = jax.device_get(fn(params, data[take], pos[take].astype(np.int32),
                               tr.target_params))
        for k, v in st.items():
            got.setdefault(k, []).extend(np.asarray(v, np.float64)[:n].tolist())
    return {"sequence_ids": [int(x) for x in ids], **got}


def held_out_prompts(val_npy: str, n: int, prompt_tokens: int, eos: int = 0) -> list:
    """[(document index, i32 ids)]: the first `prompt_tokens` tokens of n documents of the
    held-out stream `val_npy` (documents end at `eos`), evenly spaced over the documents
    long enough to hold prompt_tokens + 1 tokens."""
    toks = np.load(val_npy, mmap_mode="r")
    ends = np.flatnonzero(np.asarray(toks) == eos)
    starts = np.r_[0, ends[:-1] + 1]
    docs = [(i, s, e) for i, (s, e) in enumerate(zip(starts, ends, strict=True))
            if e - s > prompt_tokens]
    if len(docs) < n:
        raise ValueError(f"{val_npy}: {len(docs)} documents of more than {prompt_tokens} "
                         f"tokens, {n} prompts asked for")
    pick = np.linspace(0, len(docs) - 1, n).round().astype(int)
    return [(int(docs[j][0]), [int(t) for t in toks[docs[j][1]:docs[j][1] + prompt_tokens]])
            for j in pick]


def decode(target_dir: str, drafter_dir: str, prompts: list, new_tokens: int,
           settings=tuple(SETTINGS), ablate: bool = False) -> dict:
    """In-loop figures per prompt, as decode.py measures them.

    Args:
      target_dir, drafter_dir: the target's and the drafter's directories.
      prompts: [(id, ids)] (`held_out_prompts`); new_tokens: new tokens per prompt.
      settings: keys of SETTINGS to run. ablate: also run ABLATED's settings with the KV
        branch zeroed (`zero_kv_branch`; hybrid drafters only), with the same compiled loop.
    Returns: {setting: {"new_tokens", "steps", "wall_s", "ar_new_tokens", "ar_wall_s":
      [P], "accepted": [P][G], "identical": [P] (T = 0) | None, "compile_s", "gamma"}}.
    Loading and settings follow decode.py's defaults: target dtype auto (f32 on CPU),
    matmul dtype auto, drafter dtype auto (bf16 matmuls), draft vocabulary auto, kernels
    auto, batch 1, EOS on, max_length = longest prompt + new_tokens; prompt i samples with
    fold_in(key(DECODE_SEED), i), the drafter's run first, then the autoregressive one.
    """
    import jax

    from benchmarks.lib import sessions

    base = jax.random.key(DECODE_SEED)
    out = {}
    ar_engines = {}
    for name in settings:
        temp, verify = SETTINGS[name]
        # decode.py's engines: `--target T --drafter D --gamma fixed --temperature T
        # --verify V`, and `--drafter none` at the same temperature
        cfg = sessions.config(target=target_dir, drafter=drafter_dir, gamma="fixed",
                              temperature=temp, verify=verify, max_new_tokens=new_tokens)
        es = sessions.engine_set(cfg, prompts)
        main, loaded = es.main, es.session.loaded
        if temp not in ar_engines:
            ar_engines[temp] = sessions.autoregressive(cfg, prompts)
        ar = ar_engines[temp]
        compile_s = main.compile() + ar.compile()
        variants = [(name, loaded.params)]
        if ablate and name in ABLATED:
            variants.append((ABLATED[name], zero_kv_branch(loaded.params)))
        for label, dparams in variants:
            main.drafter_params = dparams
            log(f"  decode {label}: {len(prompts)} prompts")
            rec = {k: [] for k in ("new_tokens", "steps", "wall_s", "ar_new_tokens",
                                   "ar_wall_s", "accepted", "identical")}
            for i, (_, ids) in enumerate(prompts):
                key = jax.random.fold_in(base, i)
                m = main.run([ids], new_tokens, key)
                a = ar.run([ids], new_tokens, key)
                rec["new_tokens"].append(len(m.outputs[0]))
                rec["steps"].append(int(m.steps[0]))
                rec["accepted"].append([int(x) for x in m.accepted[0]])
                rec["wall_s"].append(m.wall_s)
                rec["ar_new_tokens"].append(len(a.outputs[0]))
                rec["ar_wall_s"].append(a.wall_s)
                rec["identical"].append(m.outputs[0] == a.outputs[0] if temp == 0 else None)
            rec["compile_s"] = compile_s
            rec["gamma"] = loaded.gamma
            out[label] = rec
    return out


def probes(name: str, cfg, run, params, rows: dict) -> dict:
    """The probes that apply to run `name`'s drafter: "query_cosine" (kv: TTT step 0; block
    with a KV context: block positions) and "grad" (gradient shares at init and trained)
    for drafters with a KV memory. rows: {"query": sequences, "grad": sequences}."""
    from benchmarks import kvshot_probes as kp

    dcfg = run.trainer.dcfg
    out = {}
    if dcfg.kind == "kv":
        log("  query probe (TTT)")
        out["query_cosine"] = kp.query_cosines_of(cfg, run, rows["query"])
    elif dcfg.kind == "block" and dcfg.uses_kv:
        log("  query probe (block)")
        out["query_cosine"] = kp.block_query_cosines_of(cfg, run, rows["query"])
    if dcfg.kind in ("kv", "block") and dcfg.uses_kv:
        log("  gradient probe")
        out["grad"] = kp.grad_fractions_of(cfg, run, rows["grad"], trained_params=params)
    return out


def measure_run(name: str, seed: int, *, runs_root: str = MATRIX_ROOT,
                config_dir: str = MATRIX_CONFIG_DIR, results_dir: str = RESULTS_DIR,
                overrides=(), sizes: dict | None = None, settings=DEFAULT_SETTINGS,
                val_npy: str | None = None, probe_rows: dict | None = None) -> dict:
    """Measures finished run NAME-sSEED (module docstring, items 1-3) and writes
    RESULTS_DIR/NAME-sSEED.json; returns the record.

    Args:
      runs_root, config_dir, overrides: where the run and its config are
        (`load_config_for`); sizes: SIZES' keys (missing ones from SIZES); settings: the
        in-loop settings; val_npy: the held-out stream the prompts are cut from (default:
        the config's data.val_tokens_npy); probe_rows: {"query", "grad"} sequences.
    Raises: FileNotFoundError for an unfinished run.
    """
    from benchmarks import kvshot_probes as kp

    if not is_finished(name, seed, runs_root):
        raise FileNotFoundError(f"{run_dir(name, seed, runs_root)} has no exported drafter")
    sizes = {**SIZES, **(sizes or {})}
    probe_rows = probe_rows or {"query": 2, "grad": 8}
    t0 = time.time()
    rec = {"run": f"{name}-s{seed}", "name": name, "seed": seed,
           "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "code": git_state(), "machine": machine(), "sizes": sizes}
    cfg, run = kp.run_of_config(load_config_for(name, seed, runs_root=runs_root,
                                                config_dir=config_dir, overrides=overrides))
    from specjax.models.checkpoint import fingerprint

    drafter_dir = cfg.export_dir
    rec["weights"] = {"drafter": os.path.join(*os.path.normpath(runs_root).split(os.sep)[-2:],
                                              f"{name}-s{seed}", "drafter"),
                      "drafter_sha256": _sha256(os.path.join(drafter_dir, "model.safetensors")),
                      "target": os.path.relpath(cfg.target_dir, ROOT),
                      "target_fingerprint": fingerprint(cfg.target_dir)}
    rec["train"] = training_record(run_dir(name, seed, runs_root))
    rec["kind"] = run.trainer.dcfg.kind
    rec["objective"] = cfg.objective
    params = run.trainer.load_init_params(drafter_dir, cfg.target_dir)[0]
    hybrid = run.trainer.dcfg.kind == "hybrid"

    log(f"{name}-s{seed}: simulated on {sizes['sim_rows']} held-out sequences")
    ts = time.time()
    rec["simulated"] = simulated(run, params, sizes["sim_start"], sizes["sim_rows"])
    if hybrid:
        rec["simulated_nokv"] = simulated(run, zero_kv_branch(params), sizes["sim_start"],
                                          sizes["sim_rows"])
    rec["seconds"] = {"simulated": time.time() - ts}

    ts = time.time()
    rec["probes"] = probes(name, cfg, run, params, probe_rows)
    rec["seconds"]["probes"] = time.time() - ts

    eos = run.trainer.model_cfg.eos_token_ids
    prompts = held_out_prompts(val_npy or cfg.data.val_tokens_npy, sizes["prompts"],
                               sizes["prompt_tokens"], eos=eos[0] if eos else 0)
    rec["prompt_ids"] = [p for p, _ in prompts]
    log(f"{name}-s{seed}: decoding {len(prompts)} prompts x {sizes['new_tokens']} tokens")
    ts = time.time()
    rec["decode"] = decode(cfg.target_dir, drafter_dir, prompts, sizes["new_tokens"],
                           settings, ablate=hybrid)
    rec["seconds"]["decode"] = time.time() - ts
    rec["seconds"]["total"] = time.time() - t0
    rec["machine"]["loadavg_end"] = list(os.getloadavg())
    _write_json(result_path(name, seed, results_dir), rec)
    log(f"{name}-s{seed}: done in {rec['seconds']['total']:.0f} s")
    return rec


def _write_json(path: str, obj) -> None:
    from specjax.fileio import atomic_write

    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = (json.dumps(obj, indent=1) + "\n").encode()
    atomic_write(path, lambda f: f.write(text))


def measure(names, seeds, *, force: bool = False, runs_root: str = MATRIX_ROOT,
            config_dir: str = MATRIX_CONFIG_DIR, results_dir: str = RESULTS_DIR,
            **kw) -> list[str]:
    """measure_run for every finished (name, seed) without results (all with force);
    returns the runs measured. Unfinished runs are skipped without being opened."""
    done = []
    for seed in seeds:
        for name in names:
            label = f"{name}-s{seed}"
            if not is_finished(name, seed, runs_root):
                log(f"{label}: not finished, skipped")
                continue
            if os.path.isfile(result_path(name, seed, results_dir)) and not force:
                log(f"{label}: measured already (--force to redo)")
                continue
            measure_run(name, seed, runs_root=runs_root, config_dir=config_dir,
                        results_dir=results_dir, **kw)
            done.append(label)
    return done


# ------------------------------------------------------------------ report: figures

def load_results(results_dir: str = RESULTS_DIR) -> dict:
    """{(name, seed): record} of every RESULTS_DIR/NAME-sSEED.json."""
    out = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*-s*.json"))):
        with open(path) as f:
            r = json.load(f)
        out[r["name"], int(r["seed"])] = r
    return out


def _sim_arrays(r: dict, key: str = "simulated") -> dict:
    """Per-sequence arrays f64[P] of a run's simulated record."""
    s = r[key]
    acc = np.asarray(s["accepted"], np.float64)
    cor = np.asarray(s["correct"], np.float64)
    out = {"accepted": acc.sum(1), "chains": np.asarray(s["chains"], np.float64),
           "correct0": cor[:, 0], "correctG": cor[:, -1]}
    for k in range(acc.shape[1]):
        out[f"acc{k}"] = acc[:, k]
        out[f"cor{k}"] = cor[:, k]
    return out


def _loop_arrays(r: dict, setting: str) -> dict | None:
    """Per-prompt arrays f64[P] of a run's in-loop setting (None if not measured)."""
    d = (r.get("decode") or {}).get(setting)
    if not d:
        return None
    acc = np.asarray(d["accepted"], np.float64)
    out = {"accepted": acc.sum(1), "steps": np.asarray(d["steps"], np.float64),
           "tokens": np.asarray(d["new_tokens"], np.float64),
           "wall": np.asarray(d["wall_s"], np.float64),
           "ar_tokens": np.asarray(d["ar_new_tokens"], np.float64),
           "ar_wall": np.asarray(d["ar_wall_s"], np.float64)}
    for k in range(acc.shape[1]):
        out[f"acc{k}"] = acc[:, k]
    return out


def _stack(results: dict, name: str, seeds, getter) -> tuple[dict, list] | None:
    """{key: f64[S, P]} over `seeds` of `name` (those that have the figure), and the seeds."""
    rows, used = [], []
    for s in seeds:
        r = results.get((name, s))
        a = getter(r) if r else None
        if a is not None:
            rows.append(a)
            used.append(s)
    if not rows:
        return None
    return {k: np.stack([a[k] for a in rows]) for k in rows[0]}, used


GETTERS = {"sim": lambda r: _sim_arrays(r) if "simulated" in r else None,
           "sim_nokv": lambda r: _sim_arrays(r, "simulated_nokv") if "simulated_nokv" in r
           else None}
for _s in (*SETTINGS, *ABLATED.values()):
    GETTERS[_s] = (lambda s: lambda r: _loop_arrays(r, s))(_s)

STATS = {"tau_sim": ("sim", ratio("accepted", "chains", 1.0)),
         "retention": ("sim", ratio("correctG", "correct0")),
         "acc0": ("sim", ratio("correct0", "chains")),
         "accG": ("sim", ratio("correctG", "chains")),
         "tau_sim_nokv": ("sim_nokv", ratio("accepted", "chains", 1.0))}
for _s in (*SETTINGS, *ABLATED.values()):
    STATS[f"tau_{_s}"] = (_s, ratio("accepted", "steps", 1.0))
    STATS[f"speedup_{_s}"] = (_s, speed_ratio)


def interval(results: dict, name: str, stat: str, seeds=SEEDS) -> dict | None:
    """bootstrap_ci of statistic `stat` (a STATS key) of drafter `name` over its measured
    seeds, or None when none has it; adds "seed_list"."""
    src, fn = STATS[stat]
    got = _stack(results, name, seeds, GETTERS[src])
    if got is None:
        return None
    arrays, used = got
    return {**bootstrap_ci(arrays, fn), "seed_list": used}


def paired(results: dict, a: str, b: str, stat: str, seeds=SEEDS, stat_b: str | None = None,
           ) -> dict | None:
    """bootstrap_ci of stat(a) - stat_b(b) (stat_b default: stat) over the seeds both have,
    paired by seed and prompt; None when they share no seed or their prompts differ."""
    src_a, fa = STATS[stat]
    src_b, fb = STATS[stat_b or stat]
    ga = _stack(results, a, seeds, GETTERS[src_a])
    gb = _stack(results, b, seeds, GETTERS[src_b])
    if ga is None or gb is None:
        return None
    common = [s for s in ga[1] if s in gb[1]]
    if not common:
        return None
    if not all(_same_prompts(results[a, s], results[b, s]) for s in common):
        return None
    ia = [ga[1].index(s) for s in common]
    ib = [gb[1].index(s) for s in common]
    arrays = {**{"a." + k: v[ia] for k, v in ga[0].items()},
              **{"b." + k: v[ib] for k, v in gb[0].items()}}
    return {**bootstrap_ci(arrays, difference(fa, fb)), "seed_list": common}


def _same_prompts(ra: dict, rb: dict) -> bool:
    """Same held-out prompts and (where both have one) simulated sequences."""
    sim = [r.get("simulated", {}).get("sequence_ids") for r in (ra, rb)]
    return (ra.get("prompt_ids") == rb.get("prompt_ids")
            and (None in sim or sim[0] == sim[1]))


def alpha_point(results: dict, name: str, src: str, seeds=SEEDS) -> list | None:
    """Conditional alpha_k pooled over seeds and prompts: accepted[k] / accepted[k-1]
    (alpha_0 over chains or steps); None entries where nothing reached position k."""
    got = _stack(results, name, seeds, GETTERS[src])
    if got is None:
        return None
    a = got[0]
    den = a["chains"].sum() if "chains" in a else a["steps"].sum()
    out = []
    k = 0
    while f"acc{k}" in a:
        num = a[f"acc{k}"].sum()
        out.append(float(num / den) if den else None)
        den = num
        k += 1
    return out


def acc_point(results: dict, name: str, seeds=SEEDS) -> list | None:
    """acc_k (draft k right on its own, teacher-forced) pooled over seeds and sequences."""
    got = _stack(results, name, seeds, GETTERS["sim"])
    if got is None:
        return None
    a = got[0]
    n = a["chains"].sum()
    out, k = [], 0
    while f"cor{k}" in a:
        out.append(float(a[f"cor{k}"].sum() / n))
        k += 1
    return out


# ------------------------------------------------------------------ report: rendering

MISSING = "not yet measured"


def _ci(x: dict | None, spec: str = ".2f") -> str:
    if x is None:
        return MISSING
    if not math.isfinite(x["estimate"]):
        return "-"
    return (f"{format(x['estimate'], spec)} [{format(x['lo'], spec)}, {format(x['hi'], spec)}]"
            f"{'' if x['seeds'] > 1 else '¹'}")


def _f(x, spec=".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else \
        format(x, spec)


def _seeds_cell(results: dict, name: str) -> str:
    have = [s for s in SEEDS if (name, s) in results]
    return ", ".join(map(str, have)) if have else "none"


def verdict(d: dict | None, more: str = "above", what: str = "") -> str:
    """One sentence on a paired difference's interval: above / below / across 0."""
    if d is None:
        return f"{MISSING} (a run it needs has no results yet)."
    note = "" if d["seeds"] > 1 else (" Only one seed per drafter so far: the interval "
                                      "covers prompt-to-prompt variation, not seed-to-seed.")
    lo, hi = d["lo"], d["hi"]
    span = f"{what}{d['estimate']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    if lo > 0:
        side = "lies above 0" if more == "above" else "lies above 0 (against the claim)"
        ok = more == "above"
    elif hi < 0:
        side = "lies below 0" if more == "below" else "lies below 0 (against the claim)"
        ok = more == "below"
    else:
        return f"{span}: the interval includes 0, so the evidence does not decide.{note}"
    return (f"{span}: the interval {side}, so the data {'support' if ok else 'contradict'} "
            f"it.{note}")


def table_status(results: dict, runs_root: str) -> tuple[str, list[str]]:
    """The matrix: per drafter and seed, measured / finished (not measured) / missing."""
    missing = []
    lines = ["| drafter | " + " | ".join(f"seed {s}" for s in SEEDS) + " |",
             "|---|" + "---|" * len(SEEDS)]
    for n in MATRIX:
        cells = []
        for s in SEEDS:
            if (n, s) in results:
                cells.append("measured")
            else:
                missing.append(f"{n}-s{s}")
                if is_finished(n, s, runs_root):
                    cells.append("trained, " + MISSING)
                elif os.path.isdir(run_dir(n, s, runs_root)):
                    cells.append("training (no export yet)")
                else:
                    cells.append("not trained yet")
        lines.append(f"| {LABELS[n]} | " + " | ".join(cells) + " |")
    return "\n".join(lines), missing


def table_provenance(results: dict) -> str:
    lines = ["| run | measured (UTC) | code (git) | machine | load avg (start, end) | drafter "
             "sha256 | export's step (of last eval) | its validation tau (positions 0-63) "
             "| train tok/s | seconds (sim, probes, decode) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (n, s), r in sorted(results.items(), key=lambda kv: (kv[0][1], MATRIX.index(kv[0][0])
                                                               if kv[0][0] in MATRIX else 99)):
        m, c, sec = r["machine"], r["code"], r["seconds"]
        dirty = f" + {len(c['dirty'])} changed files" if c.get("dirty") else ""
        la = f"{m['loadavg'][0]:.1f}, {m.get('loadavg_end', [math.nan])[0]:.1f}"
        where = m["cpu"] if m["backend"] == "cpu" else m.get("device", m["backend"])
        lines.append(f"| {n}-s{s} | {r['measured_at']} | `{c['rev']}`{dirty} | {where}, "
                     f"{m['cores']} cores, jax {m['jax']} ({m['backend']}) | {la} "
                     f"| `{r['weights']['drafter_sha256'][:12]}` "
                     f"| {_best_step(r['train'])} "
                     f"| {_f(r['train']['best'].get('tau'), '.3f')} "
                     f"| {_f(r['train'].get('tokens_per_s'), '.0f')} "
                     f"| {sec['simulated']:.0f}, {sec['probes']:.0f}, {sec['decode']:.0f} |")
    return "\n".join(lines)


def _best_step(train: dict) -> str:
    """"BEST of LAST" and whether validation tau still rose at the last evaluation."""
    ev = train.get("evals") or []
    best = train["best"].get("step", "-")
    if not ev:
        return str(best)
    rising = len(ev) > 1 and ev[-1]["tau"] > ev[-2]["tau"]
    return f"{best} of {ev[-1]['step']}{' (tau still rising)' if rising else ''}"


def table_simulated(results: dict) -> str:
    lines = ["| drafter | params | seeds | tau (simulated) [95% CI] | vs eagle3 | acc_0 | acc_6 "
             "| retention acc_6/acc_0 [95% CI] | alpha_0..alpha_6 (conditional) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in MATRIX:
        tau = interval(results, n, "tau_sim")
        if tau is None:
            lines.append(f"| {LABELS[n]} | | none | {MISSING} | | | | | |")
            continue
        d = paired(results, n, "eagle3", "tau_sim") if n != "eagle3" else None
        acc = acc_point(results, n)
        al = alpha_point(results, n, "sim")
        counts = sorted({r["train"].get("params") for (m, _), r in results.items() if m == n
                         and r["train"].get("params")})
        size = ", ".join(f"{c / 1e6:.2f}M" for c in counts) or "-"
        lines.append(f"| {LABELS[n]} | {size} | {_seeds_cell(results, n)} | {_ci(tau)} "
                     f"| {_ci(d, '+.2f') if n != 'eagle3' else '-'} | {acc[0]:.3f} "
                     f"| {acc[-1]:.3f} | {_ci(interval(results, n, 'retention'), '.1%')} "
                     f"| {' '.join(_f(x) for x in al)} |")
    return "\n".join(lines)


def table_loop(results: dict) -> str:
    """The in-loop table; a T = 1 column that no run measured (`--settings` left it
    out) is dropped and named below the table instead of showing "not yet measured"
    in every row."""
    optional = [("tau T=1 token", "tau_t1_token"), ("tau T=1 block", "tau_t1_block"),
                ("speedup T=1 token", "speedup_t1_token"),
                ("speedup T=1 block", "speedup_t1_block")]
    cols = [(h, k) for h, k in optional
            if any(interval(results, n, k) is not None for n in MATRIX)]
    dropped = [h for h, k in optional if (h, k) not in cols]
    lines = ["| drafter | seeds | tau T=0 [95% CI] | vs eagle3 | alpha_0..alpha_6 T=0 "
             "| speedup T=0 [95% CI] | T=0 == AR |" + "".join(f" {h} |" for h, _ in cols),
             "|" + "---|" * (7 + len(cols))]
    for n in MATRIX:
        tau = interval(results, n, "tau_t0")
        if tau is None:
            lines.append(f"| {LABELS[n]} | none | {MISSING} |" + " |" * (4 + len(cols)))
            continue
        d = paired(results, n, "eagle3", "tau_t0") if n != "eagle3" else None
        al = alpha_point(results, n, "t0")
        same = [x for s in SEEDS if (n, s) in results
                for x in results[n, s]["decode"]["t0"]["identical"]]
        lines.append(
            f"| {LABELS[n]} | {_seeds_cell(results, n)} | {_ci(tau)} "
            f"| {_ci(d, '+.2f') if n != 'eagle3' else '-'} | {' '.join(_f(x) for x in al)} "
            f"| {_ci(interval(results, n, 'speedup_t0'))} | {sum(same)}/{len(same)} |"
            + "".join(f" {_ci(interval(results, n, k))} |" for _, k in cols))
    if dropped:
        lines += ["", "Not measured in any run (`measure --settings` left them out): "
                  + ", ".join(dropped) + "."]
    return "\n".join(lines)


def table_hybrid(results: dict) -> str:
    h, c = "hybrid_from_eagle3", "eagle3_more"
    rows = [("simulated tau", interval(results, h, "tau_sim"),
             interval(results, h, "tau_sim_nokv"),
             paired(results, h, h, "tau_sim", stat_b="tau_sim_nokv"),
             interval(results, c, "tau_sim"), paired(results, h, c, "tau_sim")),
            ("in-loop tau, T=0", interval(results, h, "tau_t0"),
             interval(results, h, "tau_t0_nokv"),
             paired(results, h, h, "tau_t0", stat_b="tau_t0_nokv"),
             interval(results, c, "tau_t0"), paired(results, h, c, "tau_t0")),
            ("in-loop tau, T=1 block", interval(results, h, "tau_t1_block"),
             interval(results, h, "tau_t1_block_nokv"),
             paired(results, h, h, "tau_t1_block", stat_b="tau_t1_block_nokv"),
             interval(results, c, "tau_t1_block"), paired(results, h, c, "tau_t1_block"))]
    lines = ["| measure | hybrid_from_eagle3 | same, KV branch zeroed (gate_d = 0) "
             "| hybrid - zeroed | eagle3_more (control) | hybrid - eagle3_more |",
             "|---|---|---|---|---|---|"]
    for label, *cells in rows:
        fmt = [_ci(cells[0]), _ci(cells[1]), _ci(cells[2], "+.2f"), _ci(cells[3]),
               _ci(cells[4], "+.2f")]
        lines.append(f"| {label} | " + " | ".join(fmt) + " |")
    gates = []
    for s in SEEDS:
        r = results.get((h, s))
        if r:
            sim = r["simulated"]
            g = sum(sim.get("gate", [])) / max(sum(sim.get("gate_count", [])), 1)
            gates.append(f"seed {s}: {g:.3f} (export, held-out) / "
                         f"{_f(r['train']['best'].get('gate'), '.3f')} (training's record)")
    lines.append("")
    lines.append("Mean gate g of the hybrid: " + ("; ".join(gates) if gates else MISSING)
                 + ". The gate mean alone does not say how much the KV branch is used "
                 "(h = n + g * gate_d (o - n) also scales with gate_d and o - n); the "
                 "zeroed-branch columns measure it.")
    return "\n".join(lines)


def table_probes(results: dict) -> str:
    lines = ["| run | drafter layer | memory's initial target layer | cos(q_drafter, q_target) "
             "trained | at random init | mask positions trained (init) | best target layer "
             "(cos) | target's own queries, layers a vs b |",
             "|---|---|---|---|---|---|---|---|"]
    glines = ["| run | objective | weights | \\|grad\\| total | k_proj | v_proj | merge_k "
              "| merge_v | q_proj |", "|---|---|---|---|---|---|---|---|---|"]
    any_q = any_g = False
    for (n, s), r in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        p = r.get("probes") or {}
        q = p.get("query_cosine")
        if q:
            any_q = True
            a, b = q["target_between_layers"]
            for x in q["layers"]:
                mask = (f"{x['trained_mask']:.3f} ({x['init_mask']:.3f})"
                        if "trained_mask" in x else "-")
                lines.append(f"| {n}-s{s} | {x['layer']} | {x['target_layer']} "
                             f"| {x['trained']:.3f} | {x['init']:.3f} | {mask} "
                             f"| {x['best_target_layer']} ({x['best']:.3f}) "
                             f"| {q['target_between']:.3f} ({a} vs {b}) |")
        g = p.get("grad")
        if g:
            any_g = True
            for which in ("init", "trained"):
                x = g[which]
                cells = " | ".join(_f(x["parts"][k]["fraction"], ".3f") for k in
                                   ("k_proj", "v_proj", "merge_k", "merge_v", "q_proj"))
                glines.append(f"| {n}-s{s} | {g['objective']} | {which} | {x['total']:.3g} "
                              f"| {cells} |")
    q_text = "\n".join(lines) if any_q else f"Query probe: {MISSING} (no kv2 or block_kv run)."
    g_text = "\n".join(glines) if any_g else f"Gradient probe: {MISSING}."
    return q_text + "\n\n" + g_text


def claims(results: dict) -> str:
    """Per claim (a)-(d) of docs/kvshot.md (and the hybrid's), what the intervals allow."""
    a = paired(results, "kv2", "eagle3", "retention")
    c_sim = paired(results, "block_kv", "kv2", "tau_sim")
    c_t0 = paired(results, "block_kv", "kv2", "tau_t0")
    d_sim = paired(results, "block_kv", "block_hidden", "tau_sim")
    d_t0 = paired(results, "block_kv", "block_hidden", "tau_t0")
    d_sp = paired(results, "block_kv", "block_hidden", "speedup_t0")
    h = "hybrid_from_eagle3"
    e_ctl = paired(results, h, "eagle3_more", "tau_sim")
    e_ctl0 = paired(results, h, "eagle3_more", "tau_t0")
    e_abl = paired(results, h, h, "tau_sim", stat_b="tau_sim_nokv")
    e_abl0 = paired(results, h, h, "tau_t0", stat_b="tau_t0_nokv")
    return "\n".join([
        "**(a) KV-only retention (acc_6/acc_0) above EAGLE-3's.** kv2 minus eagle3, "
        "simulated retention: " + verdict(a, "above", "difference ") ,
        "",
        "**(b) Depth helps KV-only.** Not tested by this matrix: its minimum set has the "
        "2-layer KV-only drafter only (the pilot's kv1 and kv4 are not retrained), so the "
        "pilot's reading stands as a single-seed pilot result.",
        "",
        "**(c) Block-wise training lifts KV drafters.** block_kv (the KV-only 2-layer "
        "weights trained block-wise) minus kv2 (the same weights, TTT): simulated tau "
        + verdict(c_sim, "above", "") + " In the loop at T=0: " + verdict(c_t0, "above", ""),
        "",
        "**(d) A block drafter with KV context beats one with hidden context.** block_kv "
        "minus block_hidden: simulated tau " + verdict(d_sim, "above", "") + " In the loop "
        "at T=0, tau " + verdict(d_t0, "above", "") + " Speedup at T=0: "
        + verdict(d_sp, "above", ""),
        "",
        "**The hybrid's KV branch.** hybrid_from_eagle3 minus its control eagle3_more "
        "(eagle3 trained on for the same steps): simulated tau " + verdict(e_ctl, "above", "")
        + " In the loop at T=0: " + verdict(e_ctl0, "above", "") + " Against itself with "
        "the KV branch zeroed (simulated tau): " + verdict(e_abl, "above", "") + " In the "
        "loop at T=0: " + verdict(e_abl0, "above", ""),
    ])


def write_plots(results: dict, img_dir: str = IMG_DIR) -> list[str]:
    """docs/img/kvshot2_tau.png (tau with intervals per drafter: simulated, T=0, T=1 block)
    and docs/img/kvshot2_alpha.png (acc_k simulated, alpha_k in the loop at T=0)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specjax.fileio import atomic_write

    os.makedirs(img_dir, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(10, 4.5))
    stats = [("tau_sim", "simulated"), ("tau_t0", "in loop, T=0"),
             ("tau_t1_block", "in loop, T=1 block")]
    for j, (st, label) in enumerate(stats):
        xs, ys, err = [], [], []
        for i, n in enumerate(MATRIX):
            x = interval(results, n, st)
            if x is None or not math.isfinite(x["estimate"]):
                continue
            xs.append(i + (j - 1) * 0.25)
            ys.append(x["estimate"])
            err.append([x["estimate"] - x["lo"], x["hi"] - x["estimate"]])
        if xs:
            ax.errorbar(xs, ys, yerr=np.asarray(err).T, fmt="o", capsize=4, label=label)
    ax.set_xticks(range(len(MATRIX)))
    ax.set_xlim(-0.6, len(MATRIX) - 0.4)
    ax.set_xticklabels(MATRIX, rotation=15)
    ax.set_ylabel("tau (tokens per verification), 95% CI")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    ax.set_title("Redone KVShot study: tau per drafter (missing drafters have no point)")
    fig.tight_layout()
    paths.append(_save_fig(fig, os.path.join(img_dir, "kvshot2_tau.png"), atomic_write, io))
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, n in enumerate(MATRIX):
        style = "--" if n.startswith("block") else "-"
        acc = acc_point(results, n)
        if acc:
            axes[0].plot(range(len(acc)), acc, style, marker="o", color=f"C{i}", label=n)
        al = alpha_point(results, n, "t0")
        if al:
            axes[1].plot(range(len(al)), [np.nan if a is None else a for a in al], style,
                         marker="o", color=f"C{i}", label=n)
    axes[0].set_title("acc_k, simulated (teacher-forced, held-out)")
    axes[1].set_title("alpha_k in the loop (T=0, held-out prompts)")
    for ax in axes:
        ax.set_xlabel("draft position k")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save_fig(fig, os.path.join(img_dir, "kvshot2_alpha.png"), atomic_write, io))
    plt.close(fig)
    return paths


def _save_fig(fig, path, atomic_write, io) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    atomic_write(path, lambda f: f.write(buf.getvalue()))
    return path


def provenance(results_dir: str) -> dict:
    """RESULTS_DIR/provenance.json when there is one (written by hand for runs made
    elsewhere, e.g. on a lent accelerator): {"commands": [lines of the commands block],
    "report": the report command, "weights": where the exports were, "machine": the
    machine paragraph, "notes": [more setup items]}; {} otherwise."""
    path = os.path.join(results_dir, "provenance.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def budget_text(results: dict, runs_root: str) -> tuple[str, str]:
    """(the training budget read from the runs' saved config.yaml files, a sentence on
    whether validation tau still rose at the end)."""
    import yaml

    plans, warm = set(), set()
    for (n, s) in results:
        path = os.path.join(run_dir(n, s, runs_root), "config.yaml")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            c = yaml.safe_load(f) or {}
        t, d = c.get("train", {}), c.get("data", {})
        plan = (t.get("steps"), t.get("batch_size"), t.get("grad_accum", 1), d.get("seq_len"))
        (warm if t.get("init_from") else plans).add(plan)
    def one(p):
        steps, b, acc, seq = p
        return f"{steps} steps of B {b * acc} x T {seq} = {steps * b * acc * seq:,} tokens"
    if not plans:
        budget = "runs' configs not found"
    else:
        budget = "; ".join(one(p) for p in sorted(plans))
    if warm:
        budget += ("; eagle3_more and hybrid_from_eagle3 train "
                   + "; ".join(one(p) for p in sorted(warm))
                   + " more from the same seed's eagle3 export")
    rising = [(n, s) for (n, s), r in results.items()
              if len(r["train"].get("evals") or []) > 1
              and r["train"]["evals"][-1]["tau"] > r["train"]["evals"][-2]["tau"]]
    gains = [r["train"]["evals"][-1]["tau"] - r["train"]["evals"][-2]["tau"]
             for (n, s), r in results.items() if (n, s) in rising]
    if rising:
        plateau = (f"A stated budget, not a plateau: validation tau still rose at the last "
                   f"evaluation in {len(rising)} of {len(results)} runs (by "
                   f"{min(gains):.3f} to {max(gains):.3f} over the last evaluation interval, "
                   "with the learning rate at the end of its cosine decay), so every "
                   "figure is a figure at this budget, the same for all.")
    else:
        plateau = "Every run's validation tau stopped rising before its last evaluation."
    return budget, plateau


def render(results: dict, *, runs_root: str = MATRIX_ROOT, doc: str = DOC,
           img_dir: str | None = IMG_DIR, results_dir: str = RESULTS_DIR) -> str:
    """The text of docs/kvshot2.md from `results` (`load_results`); writes it to `doc`
    (None: not written) and the plots to `img_dir` (None: none). Returns the text."""
    status, missing = table_status(results, runs_root)
    sizes = sorted({json.dumps(r["sizes"], sort_keys=True) for r in results.values()})
    sizes_text = "; ".join(", ".join(f"{k} {v}" for k, v in json.loads(s).items())
                           for s in sizes) or "-"
    imgs = []
    if img_dir is not None:
        imgs = write_plots(results, img_dir)
    rel = [os.path.relpath(p, os.path.dirname(doc) if doc else ROOT) for p in imgs]
    missing_text = ", ".join(missing) if missing else "none"
    prov = provenance(results_dir)
    commands = prov.get("commands") or [
        "python benchmarks/kvshot.py matrix                 # trains runs/study2/NAME-sSEED",
        "python benchmarks/kvshot_study2.py measure         # finished runs without results",
        "python benchmarks/kvshot_study2.py report          # this page and its plots"]
    budget, plateau = budget_text(results, runs_root)
    gpu = sorted({r["machine"].get("device", r["machine"]["backend"]) for r in results.values()
                  if r["machine"]["backend"] != "cpu"})
    cpu = any(r["machine"]["backend"] == "cpu" for r in results.values())
    target_dtype = ("f32" if not gpu else "bf16" if not cpu else
                    "f32 on CPU, bf16 on an accelerator")
    weights_where = prov.get("weights", "runs/study2/NAME-sSEED/drafter")
    machine_text = prov.get("machine") or (
        "every figure below was measured on this 2-core CPU (no accelerator), beside the "
        "matrix's training job (load averages in the provenance table); speedups are ratios "
        "within one process and one prompt, but absolute tokens/s on a shared CPU are not "
        "comparable across runs.")
    parts = [
        "# The KVShot study, redone (issue 29): seeds, equal terms, intervals",
        "",
        f"<!-- generated by `{prov.get('report', 'python benchmarks/kvshot_study2.py report')}`"
        f" from {os.path.relpath(results_dir, ROOT)}/*.json: edit the generator, not this "
        "file -->",
        "",
        f"**Status: {len(results)} of {len(MATRIX) * len(SEEDS)} runs measured.** Missing: "
        f"{missing_text}. Rows of drafters without results say \"{MISSING}\"; a figure "
        "marked ¹ comes from one seed, so its interval covers the prompts only. The pilot "
        "study (one seed, unequal terms) is docs/kvshot.md, left as it was.",
        "",
        "```bash",
        *commands,
        "```",
        "",
        "## Setup",
        "",
        "- Target: checkpoints/demo/target (24.7M parameters, frozen). Drafters: "
        "configs/study2/*.yaml, the same regenerated data (the target's own greedy text, "
        f"benchmarks/data/study2/), the same budget ({budget}), 64 TTT chains or 64 "
        "blocks of G = 7 per sequence, every context at target depths 2, 4, 5, seeds 0, 1, "
        "2 (train.seed). Each export is the best-tau snapshot of its run's validation "
        "(held-out positions 0-63).",
        f"- {plateau}",
        "- Simulated: the trainer's own validation statistics "
        "(DrafterTrainer.loss_and_stats, evaluation mode) per held-out sequence, on "
        "sequences that took no part in choosing the export (positions sim_start .. "
        "sim_start + sim_rows of the held-out order, T = 256). tau = 1 + sum of accepted "
        "drafts / chains; acc_k: draft k right on its own; alpha_k: conditional.",
        "- In the loop: specjax.decoding.engine.Engine as decode.py builds it "
        f"({target_dtype} target, bf16 drafter matmuls, batch 1, EOS on, kernels auto) on "
        "`prompts` prompts cut from held-out documents (their first prompt_tokens tokens), "
        "new_tokens new tokens each; each prompt decoded by the drafter and then "
        "autoregressively with the same key, so the speedup is a within-process ratio. "
        "tau = 1 + accepted / verification steps.",
        f"- Sizes: {sizes_text}.",
        f"- Weights: each run's exported drafter ({weights_where}; sha256 "
        "prefix of its model.safetensors in the provenance table); target fingerprint "
        "(specjax.models.checkpoint.fingerprint) "
        + (", ".join(sorted({f"`{r['weights']['target_fingerprint'][:12]}`"
                             for r in results.values()})) or "-") + ".",
        f"- Intervals: 95% percentile intervals of a crossed bootstrap ({RESAMPLES} "
        "resamples, numpy seed 0) that draws seeds and prompts (or held-out sequences) with "
        "replacement, independently, and recomputes the statistic from totals; a difference "
        "between two drafters resamples both with the same seeds and prompts (paired; seed "
        "pairs share the seed index, and a warm-started run shares its seed's eagle3).",
        f"- Machine: {machine_text}",
        *[f"- {x}" for x in prov.get("notes", [])],
        "",
        "## Runs",
        "",
        status,
        "",
        "Provenance (code = the git revision measured; + N changed files = uncommitted "
        "changes under specjax/, decode.py or benchmarks/ at the time):",
        "",
        table_provenance(results) if results else MISSING,
        "",
        "## Simulated acceptance on held-out sequences",
        "",
        table_simulated(results),
        "",
        "## In the decoding loop",
        "",
        table_loop(results),
        "",
        *[f"![{os.path.basename(p)}]({p})" for p in rel],
        "",
        "## The hybrid: its KV branch zeroed, and its control",
        "",
        table_hybrid(results),
        "",
        "## Probes",
        "",
        "Query cosine: per drafter layer, the cosine between its queries and the target's "
        "own queries at the layer its merged memory started from (kv2: TTT step 0; block_kv: "
        "block position 0, the anchor token, and the mask positions). Gradient share: the "
        "fraction of the loss gradient's norm reaching the drafter's own K/V projections and "
        "merge maps, at random init and at the trained weights.",
        "",
        table_probes(results),
        "",
        "## What the intervals allow, per claim of the pilot (docs/kvshot.md)",
        "",
        claims(results),
        "",
    ]
    text = "\n".join(parts)
    if doc is not None:
        from specjax.fileio import atomic_write

        os.makedirs(os.path.dirname(doc), exist_ok=True)
        atomic_write(doc, lambda f: f.write(text.encode()))
    return text


# ------------------------------------------------------------------ CLI

def main(argv=None) -> int:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs-root", default=MATRIX_ROOT, help="where NAME-sSEED runs live")
    ap.add_argument("--results-dir", default=RESULTS_DIR, help="per-run result JSON files")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="measure finished runs that have no results yet")
    m.add_argument("--only", nargs="+", choices=MATRIX, help="these drafters only")
    m.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    m.add_argument("--prompts", type=int, default=SIZES["prompts"], help="in-loop prompts")
    m.add_argument("--sim-rows", type=int, default=SIZES["sim_rows"],
                   help="held-out sequences for the simulated figures")
    m.add_argument("--new-tokens", type=int, default=SIZES["new_tokens"])
    m.add_argument("--force", action="store_true", help="measure again runs with results")
    m.add_argument("--settings", nargs="+", choices=tuple(SETTINGS),
                   default=list(DEFAULT_SETTINGS), help="in-loop settings")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override the runs were trained with (repeatable)")
    r = sub.add_parser("report", help="render docs/kvshot2.md and plots from the results")
    r.add_argument("--doc", default=DOC)
    r.add_argument("--img-dir", default=IMG_DIR)
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # configs name the target and data relative to the checkout
    if args.cmd == "measure":
        names = [n for n in MATRIX if not args.only or n in args.only]
        sizes = {"prompts": args.prompts, "sim_rows": args.sim_rows,
                 "new_tokens": args.new_tokens}
        from specjax.compile_cache import enable_compile_cache

        enable_compile_cache(None)  # decode.py's default: the AR loops compile once
        done = measure(names, args.seeds, force=args.force, runs_root=args.runs_root,
                       results_dir=args.results_dir, sizes=sizes,
                       settings=tuple(args.settings), overrides=tuple(args.set))
        log(f"measured {len(done)} runs: {', '.join(done) or 'none'}")
        return 0
    results = load_results(args.results_dir)
    render(results, runs_root=args.runs_root, doc=args.doc, img_dir=args.img_dir,
           results_dir=args.results_dir)
    log(f"{len(results)} runs with results; wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
