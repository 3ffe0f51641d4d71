"""What a decoding session reports: the summary dict (decode.py --summary), its table on the
terminal, the output records (decode.py --output) and a completion shown with its prompt."""

from __future__ import annotations

import dataclasses

from specjax.decoding import kernel_policy


def summary(session, plan, num_prompts: int, chat: bool, timing: dict | None) -> dict:
    """The run's figures from a session and its `specjax.decoding.engines.EngineSet`
    (after the batches ran): tokens/s, tau, alpha_k, the rule, the modes and their
    counters, the adaptive schedule's record, and against the autoregressive reference
    the speedup and whether the outputs are identical (greedy)."""
    c, st, main = session.cfg, plan.stats["main"], plan.main
    drafter, loaded, partial = session.drafter, session.loaded, main.cfg.partial
    greedy = session.sampling.greedy
    out = {"new_tokens": st.new_tokens, "wall_s": st.wall_s, "compile_s": st.compile_s,
           "tokens_per_s": st.tokens_per_s,
           "tau": st.tau if drafter is not None else None,
           "alpha": st.alpha if drafter is not None else [],
           "drafter": loaded.name, "gamma": loaded.gamma if drafter is not None else 0,
           "verify": main.cfg.rule().name,
           "lossy": main.cfg.lossy,
           "fly": ({"window": main.cfg.verify.window,
                    "entropy_threshold": main.cfg.verify.threshold}
                   if c.verify == "fly" else None),
           "partial_verify": None if partial is None else {
               "budget": partial.budget, "block": partial.block,
               "sink_blocks": partial.sink_blocks, "window": partial.window,
               "buffer": partial.buffer, "threshold": partial.threshold_for(loaded.gamma),
               "full_steps": int(st.verified[0]) if st.verified is not None else 0,
               "partial_steps": int(st.verified[1]) if st.verified is not None else 0},
           "kernels": main.cfg.kernels,
           "kernel_paths": kernel_policy.describe(main.cfg, drafter)[0],
           "ar_identity_guaranteed": session.identity_guaranteed,
           "ar_identity": session.identity, "exact": c.exact,
           "num_drafts": main.cfg.num_drafts,
           "nodes_per_step": (main.cfg.tree_nodes(loaded.gamma, drafter)
                              if drafter is not None else 1),
           "batch_size": c.batch_size, "prompts": num_prompts, "chat": chat,
           "mesh": dict(plan.mesh.shape) if plan.mesh is not None else None,
           "draft_window": c.draft_window,
           "draft_reuse": None if st.reused is None else {
               "states_reused": int(st.reused[0]), "states_drafted": int(st.reused[1]),
               "fraction": float(st.reused[0] / max(st.reused[1], 1)),
               "forwards_skipped": int(st.reused[2]), "forwards": int(st.reused[3])}}
    if timing is not None:
        out.update(timing)
    if session.constraint_stats is not None:
        out["constraint"] = dict(session.constraint_stats)
    sched = plan.schedule
    if sched is not None:
        steps = [int(n) for n in st.chosen] if st.chosen is not None else []
        out["gamma_schedule"] = {
            "choices": list(sched.choices), "steps": steps,
            "mean_draft_length": (sum(g * n for g, n in zip(sched.choices, steps, strict=True))
                                  / max(sum(steps), 1)),
            "ms_per_step": [round(float(m), 3) for m in main.costs],
            "baseline": None if main.baseline is None else dataclasses.asdict(main.baseline),
            "autoregressive_batches": st.fallback_batches, "batches": st.batches,
            "cost_table": (plan.table if plan.calibrated_s is None or plan.table_written
                           else None),
            "measured_at": plan.measured_at, "calibration_s": plan.calibrated_s,
            "calibration_relative": plan.relative}
    if c.compare_ar:
        ar = plan.stats.get("ar", st)
        out["ar_tokens_per_s"] = ar.tokens_per_s
        out["speedup"] = st.tokens_per_s / ar.tokens_per_s
        if "ar" in plan.outputs and greedy:
            out["ar_identical"] = plan.outputs["ar"] == plan.outputs["main"]
            if out["lossy"]:  # how far the lossy output is from the target's
                from specjax.decoding.fly import agreement

                out["ar_agreement"] = agreement(plan.outputs["main"], plan.outputs["ar"])
    return out


def records(prompts, outputs, tokenizer, constraints=None) -> list[dict]:
    """One output record per prompt, in input order: id, prompt_ids, output_ids (new
    tokens only) and text (when the target has a tokenizer); for a prompt under a
    constraint (`constraints`, a `specjax.constraints.ConstraintSet`) also "regex" and
    "matched": whether the output reached an accepting state of its automaton (False:
    cut at --max-new-tokens before the pattern was complete)."""
    out = []
    for (pid, prompt_ids), ids in zip(prompts, outputs, strict=True):
        rec = {"id": pid, "prompt_ids": list(prompt_ids), "output_ids": ids}
        if tokenizer is not None:
            rec["text"] = tokenizer.decode(ids, skip_special_tokens=True)
        regex = getattr(prompt_ids, "regex", None)
        if regex is not None and constraints is not None:
            rec["regex"] = regex
            rec["matched"] = constraints.matched(regex, ids)
        out.append(rec)
    return out


def show(rec: dict, tokenizer, context_lines: int = 4) -> str:
    """The last lines of the prompt, then the completion, for the terminal."""
    prompt_ids = rec["prompt_ids"]
    if tokenizer is None:
        return (f"=== {rec['id']}: {len(prompt_ids)} prompt tokens -> "
                f"{' '.join(map(str, rec['output_ids']))}")
    tail = tokenizer.decode(prompt_ids, skip_special_tokens=True).splitlines()[-context_lines:]
    n = len(rec["output_ids"])
    return (f"=== prompt {rec['id']} (last {len(tail)} lines)\n" + "\n".join(tail)
            + f"\n--- completion ({n} tokens)\n{rec['text']}\n")


def title(summary: dict) -> str:
    """The summary's heading: drafter, draft length and rule."""
    sched = summary.get("gamma_schedule")
    return f"summary ({summary['drafter']}, G={'auto' if sched else summary['gamma']}, " \
           f"{summary['verify']}):"


def format_summary(summary: dict) -> str:
    """The summary as an aligned two-column table for the terminal."""
    rows = []
    if summary.get("verify") == "fly":
        rows.append(("verification", "fly: LOSSY, the output is not the target's"))
    pv = summary.get("partial_verify")
    if pv:
        rows.append(("verification", "partial (SpecPV): LOSSY, the output is not the "
                                     "target's"))
        rows.append(("steps full / partial", f"{pv['full_steps']} / {pv['partial_steps']} "
                                             f"(budget {pv['budget']}, from "
                                             f"{pv['threshold']} tokens)"))
    rows += [("new tokens", f"{summary['new_tokens']}"),
             ("wall (s, no compile)", f"{summary['wall_s']:.2f}"),
             ("compile (s)", f"{summary['compile_s']:.2f}"),
             ("tokens/s", f"{summary['tokens_per_s']:.1f}")]
    if summary.get("tau") is not None:
        rows.append(("tau (tokens/step)", f"{summary['tau']:.3f}"))
        sched = summary.get("gamma_schedule")
        if sched:
            mix = ", ".join(f"{g}: {n}" for g, n in zip(sched["choices"], sched["steps"],
                                                         strict=True) if n)
            rows.append(("draft length: steps", f"{mix} (mean {sched['mean_draft_length']:.2f})"))
            if sched.get("autoregressive_batches"):
                rows.append(("autoregressive batches",
                             f"{sched['autoregressive_batches']} of {sched['batches']} "
                             "(speculation would not pay at this batch size)"))
            if sched.get("calibration_s") is None and sched.get("cost_table"):
                rows.append(("cost table", f"read from {sched['cost_table']}"
                             + (f" (measured {sched['measured_at']})"
                                if sched.get("measured_at") else "")
                             + "; delete it to measure again"))
        rows.append(("alpha_k", " ".join("-" if a is None else f"{a:.2f}"
                                         for a in summary["alpha"])))
        if summary.get("nodes_per_step", 1) > summary.get("gamma", 0) + 1:
            rows.append(("drafts x nodes/step", f"{summary['num_drafts']} x "
                                                f"{summary['nodes_per_step']}"))
    kp = summary.get("kernel_paths")
    if kp and kp["verify"] != "none":
        rows.append(("kernels", f"verification {kp['verify']}, target attention "
                                f"{kp['target_attention']}"))
    con = summary.get("constraint")
    if con:
        matched = "" if con.get("matched") is None else (
            f"; outputs complete {con['matched']} of {con['prompts']}")
        rows.append(("constraint", f"{con['patterns']} pattern(s), {con['states']} states x "
                                   f"{con['token_classes']} token classes, "
                                   f"{con['table_bytes'] / 1e6:.2f} MB, compiled in "
                                   f"{con['compile_s']:.2f} s{matched}"))
    if "draft_ms" in summary:
        rows.append(("draft / verify ms per step", f"{summary['draft_ms']:.1f} / "
                                                   f"{summary['verify_ms']:.1f} (outside the loop)"))
    if "speedup" in summary:
        rows.append(("AR tokens/s", f"{summary['ar_tokens_per_s']:.1f}"))
        rows.append(("speedup over AR", f"{summary['speedup']:.2f}x"))
        if summary.get("ar_identical") is not None:
            same = str(summary["ar_identical"])
            if summary.get("ar_identity_guaranteed") is False and not summary.get("lossy"):
                same += " (bf16: not guaranteed)"
            elif summary.get("exact"):
                same += " (--exact: bit-identical by construction)"
            rows.append(("identical to AR", same))
        agree = summary.get("ar_agreement")
        if agree:
            rows.append(("LOSSY: agreement", f"{agree['prefix_tokens']:.1f} tokens before the "
                                             f"first difference (mean), "
                                             f"{agree['token_agreement']:.1%} of positions"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)
