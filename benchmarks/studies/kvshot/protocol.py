"""The redone KVShot study's measurement protocol (issue 29, section 2) and the statistics of
its results, shared by its script (kvshot_study2.py: `measure`, `report`), its device
driver (kvshot_device.py) and benchmarks/medc.py, which measures medc against eagle3 the
same way.

A run NAME-sSEED of the matrix (configs/study2/, runs/study2/, kvshot_runs.py) is
measured by `measure_run` into RESULTS_DIR/NAME-sSEED.json: simulated acceptance on
held-out sequences (`simulated`), in-loop acceptance and speed (`decode`: decode.py's
engines, built as decoding sessions) and probes (`probes`); kvshot_study2.py's docstring
describes each. `load_results`, `interval` and `paired` turn those files into paired
bootstrap intervals over seeds and prompts (`benchmarks.lib.stats.bootstrap_ci`).
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # this checkout's specjax first (an installed copy may differ)

from benchmarks.lib.prompts import VAL_NPY, held_out_prompts  # noqa: E402
from benchmarks.lib.provenance import git_state, machine, sha256  # noqa: E402
from benchmarks.lib.report import write_json  # noqa: E402
from benchmarks.lib.stats import bootstrap_ci, difference, ratio, speed_ratio  # noqa: E402
from benchmarks.studies.kvshot.kvshot_runs import (  # noqa: E402
    MATRIX_CONFIG_DIR,
    MATRIX_ROOT,
    SEEDS,
)

RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results", "studies", "kvshot", "kvshot2")

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
__all__ = ["ABLATED", "DECODE_SEED", "DEFAULT_SETTINGS", "GETTERS", "MISSING", "RESULTS_DIR",
           "SETTINGS", "SIM_KEY", "SIZES", "STATS", "VAL_NPY", "acc_point", "alpha_point",
           "bootstrap_ci", "ci", "decode", "difference", "held_out_prompts", "interval",
           "is_finished", "load_config_for", "load_results", "log", "measure",
           "measure_run", "paired", "probes", "ratio", "result_path", "run_dir",
           "simulated", "speed_ratio", "training_record", "write_json", "zero_kv_branch"]


def log(msg: str) -> None:
    print(f"[kvshot2] {msg}", file=sys.stderr, flush=True)


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
    from benchmarks.studies.kvshot import kvshot_probes as kp

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
    from benchmarks.studies.kvshot import kvshot_probes as kp

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
                      "drafter_sha256": sha256(os.path.join(drafter_dir, "model.safetensors")),
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
    write_json(result_path(name, seed, results_dir), rec)
    log(f"{name}-s{seed}: done in {rec['seconds']['total']:.0f} s")
    return rec


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


# ------------------------------------------------------------------ results and their statistics

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


# ------------------------------------------------------------------ formatting

MISSING = "not yet measured"


def ci(x: dict | None, spec: str = ".2f") -> str:
    if x is None:
        return MISSING
    if not math.isfinite(x["estimate"]):
        return "-"
    return (f"{format(x['estimate'], spec)} [{format(x['lo'], spec)}, {format(x['hi'], spec)}]"
            f"{'' if x['seeds'] > 1 else '¹'}")



