"""The systems that benchmarks/compare.py times, and how it times them.

    systems = [SpecjaxSystem("specjax-ar", engine, rows, 128, temperature=0.0, verify=None,
                             seed=0), TransformersSystem(...)]
    measured = measure(systems, repeats=3, new_tokens=128, log=print)
    record = system_record(systems[0], measured["specjax-ar"])

A system generates `new_tokens` for every row of its prompts (batch by batch for specjax
engines, one prompt at a time for transformers `generate`); `measure` compiles and warms
up each system once, then times `repeats` interleaved runs.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from benchmarks.lib.stats import summary


@dataclasses.dataclass
class RunResult:
    """One run of a system over all its rows."""

    outputs: list[list[int]]  # new tokens per row
    call_walls: list[float]  # seconds per generate call
    stats: object | None = None  # engine.Stats (specjax)
    target_forwards: int | None = None  # transformers, counted when asked

    @property
    def wall(self) -> float:
        return sum(self.call_walls)

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def load_transformers(model_dir):
    """transformers model (torch, f32, eval mode) with EOS disabled."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    gc = model.generation_config
    gc.eos_token_id = None
    gc.pad_token_id = 0  # no EOS to fall back on; silences the pad warning
    return model


class SpecjaxSystem:
    """An engine (a session's: `benchmarks.lib.sessions.engine`) over `rows` (lists of
    token ids), batch by batch; `drafter` names the drafter for the tables (None:
    autoregressive)."""

    kind = "specjax"

    def __init__(self, name, engine, rows, new_tokens, *, temperature, verify, seed,
                 drafter=None):
        self.name, self.engine, self.rows, self.new_tokens = name, engine, rows, new_tokens
        self.temperature, self.verify, self.seed = temperature, verify, seed
        self.drafter = drafter
        self.gamma = engine.gamma or None
        self.batch_size = engine.batch_size
        self.compile_s = None

    def compile(self) -> float:
        self.compile_s = self.engine.compile()
        return self.compile_s

    def run(self, count: bool = False) -> RunResult:
        from specjax.decoding.engine import Stats

        stats, outputs, walls = Stats(), [], []
        base = jax.random.key(self.seed)
        B = self.batch_size
        for i in range(0, len(self.rows), B):
            key = jax.random.fold_in(base, i // B)  # batch 1: one key per prompt
            t0 = time.perf_counter()
            out = self.engine.run(self.rows[i:i + B], self.new_tokens, key)
            walls.append(time.perf_counter() - t0)
            stats.add(out)
            outputs.extend(out.outputs)
        return RunResult(outputs, walls, stats=stats)


class TransformersSystem:
    """transformers `generate` (torch, greedy) one prompt at a time, with `generate_kwargs`
    (assistant_model, prompt_lookup_num_tokens, ...)."""

    kind = "transformers"
    drafter = None
    temperature = 0.0
    batch_size = 1
    compile_s = None

    def __init__(self, name, model, rows, new_tokens, threads, *, gamma=None, verify=None,
                 **generate_kwargs):
        import torch

        self.name, self.model, self.new_tokens, self.threads = name, model, new_tokens, threads
        self.gamma, self.verify, self.kwargs, self.torch = gamma, verify, generate_kwargs, torch
        self.ids = [torch.tensor([r], dtype=torch.long) for r in rows]

    def compile(self) -> float:
        return 0.0

    def run(self, count: bool = False) -> RunResult:
        torch = self.torch
        torch.set_num_threads(self.threads)  # process-wide: set before every run
        forwards = [0]
        handle = None
        if count:
            def hook(module, inputs):
                forwards[0] += 1
            handle = self.model.register_forward_pre_hook(hook)
        outputs, walls = [], []
        try:
            with torch.inference_mode():
                for ids in self.ids:
                    mask = torch.ones_like(ids)
                    t0 = time.perf_counter()
                    out = self.model.generate(
                        ids, attention_mask=mask, do_sample=False,
                        max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                        eos_token_id=None, use_cache=True, **self.kwargs)
                    walls.append(time.perf_counter() - t0)
                    outputs.append(out[0, ids.shape[1]:].tolist())
        finally:
            if handle is not None:
                handle.remove()
        return RunResult(outputs, walls, target_forwards=forwards[0] if count else None)


def measure(systems, repeats: int, new_tokens: int, log=print) -> dict:
    """Compile + one untimed warm-up per system, then `repeats` interleaved timed runs."""
    res = {}
    for s in systems:
        c = s.compile()
        log(f"{s.name}: compile {c:.2f} s; warm-up run" if c else f"{s.name}: warm-up run")
        ref = s.run(count=True)
        short = [len(o) for o in ref.outputs if len(o) != new_tokens]
        if short:
            log(f"WARNING: {s.name} generated {short[0]} tokens for a row, not {new_tokens}")
        res[s.name] = {"ref": ref, "runs": [], "stable": True}
    for r in range(repeats):
        k = r % len(systems)
        for s in systems[k:] + systems[:k]:
            run = s.run()
            entry = res[s.name]
            if run.outputs != entry["ref"].outputs:
                entry["stable"] = False
                log(f"WARNING: {s.name}: output changed between runs")
            entry["runs"].append(run)
            log(f"repeat {r + 1}/{repeats} {s.name}: {run.new_tokens} tokens in "
                f"{run.wall:.2f} s, {run.new_tokens / run.wall:.1f} tok/s")
    return res


def system_record(s, m: dict) -> dict:
    """Raw figures of one measured system."""
    ref, runs = m["ref"], m["runs"]
    rec = {
        "kind": s.kind, "drafter": s.drafter, "temperature": s.temperature,
        "verify": s.verify, "gamma": s.gamma,
        "batch_size": s.batch_size, "rows": len(ref.outputs),
        "new_tokens_per_run": ref.new_tokens,
        "wall_s": [r.wall for r in runs],
        "call_wall_s": [r.call_walls for r in runs],
        "tokens_per_s": summary([r.new_tokens / r.wall for r in runs]),
        "compile_s": s.compile_s,
        "tau": None, "alpha": None, "steps": None, "accepted": None, "target_forwards": None,
        "outputs_stable": m["stable"],
        "outputs": ref.outputs,
    }
    if ref.stats is not None:
        rec["engine_wall_s"] = [r.stats.wall_s for r in runs]
        rec["steps"] = ref.stats.steps
        if s.gamma:
            rec["accepted"] = ref.stats.accepted.tolist()
            rec["tau"] = ref.stats.tau
            rec["alpha"] = ref.stats.alpha
    if ref.target_forwards is not None:
        rec["target_forwards"] = ref.target_forwards
        if s.gamma:
            rec["tau"] = ref.new_tokens / ref.target_forwards
    return rec


def compact(rec: dict, name: str) -> dict:
    """A sweep entry: the record without its outputs (equality is recorded instead)."""
    return {"system": name} | {k: v for k, v in rec.items() if k != "outputs"}
