"""The drafter kinds: one registry that generic code asks (docs/design.md section 11).

A drafter kind is one module that defines its network (an nnx.Module), its loop adapter
(a `learned.LearnedDrafter`) and a `DrafterKind` describing them, and registers it:

    class ToyKind(registry.DrafterKind):
        name, network, adapter, objective = "toy", ToyNet, ToyDrafter, "ttt"
        def defaults(self, target, opts): ...      # what DrafterConfig.for_target fills in
        def uses_hidden(self, cfg): return True
        ...
    registry.register(ToyKind())

`DrafterConfig` (validation, for_target, check_target, uses_hidden/uses_kv/num_memories),
`drafters.build_network` / `make_drafter` (network, adapter, early stop), the training
config (which objective trains which kind), the memory planner (decoding-state size) and
decode.py's help ask the registry; none of them names a kind. The built-in kinds (eagle3,
kv, hybrid, block) register when their modules are imported, which the registry does the
first time it is asked.
"""

from __future__ import annotations

import importlib
import threading

from specjax.errors import SpecjaxError

# Modules of the built-in kinds, in the order their kinds are listed.
BUILTIN_MODULES = ("specjax.drafters.eagle3", "specjax.drafters.kv", "specjax.drafters.hybrid",
                   "specjax.drafters.block", "specjax.drafters.medc")

_KINDS: dict[str, DrafterKind] = {}
_lock = threading.RLock()
_loaded = False


class DrafterKind:
    """What generic code needs to know about one drafter kind. Subclass, set the class
    attributes and override the methods whose defaults do not fit, then `register` an
    instance.

    Attributes:
      name: the `DrafterConfig.kind` string (config.json's "kind").
      network: the nnx.Module class; `network(dcfg, dtype=..., rngs=...)` builds it. For
        objective "ttt" it has `ttt(hidden, kv, tokens, embed, inv_freq, steps,
        anchors=None, kernel=None) -> (outputs [steps,B,P,D], gates | None)` and
        `logits(out, head)` (docs/design.md 6); for "block", `contexts` /
        `blocks(..., kernel=None)` / `logits` (objectives/block.py). kernel: the
        attention kernel its `attend` calls take (`specjax.decoding.kernel_policy`; None: jnp).
      adapter: the loop adapter class (`specjax.core.drafter.Drafter`), constructed as
        `adapter(graphdef, dcfg, gamma, sampling, stop_below)`; a learned adapter
        (`learned.LearnedDrafter`) also has an `attention` field, the kernel the loop
        sets (`specjax.decoding.kernel_policy.with_drafter_attention`).
      objective: the training objective that trains it: "ttt" or "block".
      early_stop: whether its adapter honours `stop_below` (decode.py --draft-stop).
      settings: DrafterConfig fields only this kind uses, each with its allowed values
        (None: any value); other kinds must leave them None.
      reads_target_kv_shapes: its attention must have the target's N, K, H (it reads
        target K/V or shares its layout); False: only D, V and L must match the target.
      default_num_layers: Ld when the user gives none.
    """

    name: str = ""
    network: type = None
    adapter: type = None
    objective: str = "ttt"
    early_stop: bool = False
    settings: dict = {}
    reads_target_kv_shapes: bool = True
    default_num_layers: int = 1

    # ------------------------------------------------------------- config facts

    def defaults(self, target, opts: dict) -> dict:
        """The kind's part of `DrafterConfig.for_target(target, ...)`: given opts
        {"num_layers" (already defaulted), "context", "num_kv_layers", "mask_token_id"},
        returns {"capture", "kv_layers"} and any of its `settings` (others stay None)."""
        return {"capture": (), "kv_layers": ()}

    def validate(self, cfg) -> None:
        """Kind-specific checks of a DrafterConfig (after the generic ones); raises
        SpecjaxError."""

    def uses_hidden(self, cfg) -> bool:
        """Reads target hidden states at `cfg.capture`."""
        return False

    def uses_kv(self, cfg) -> bool:
        """Reads the target KV cache at `cfg.kv_layers`."""
        return False

    def num_memories(self, cfg) -> int:
        """Merged target-KV memories (`memory.merge_init`): one per drafter layer unless
        overridden; 0 when it reads no target K/V."""
        return cfg.num_layers if self.uses_kv(cfg) else 0

    def state_layers(self, cfg) -> int:
        """How many [B,K,S,H] key/value caches its decoding state holds (the memory
        planner's "drafter state")."""
        return cfg.num_layers


def register(kind: DrafterKind, *, replace: bool = False) -> DrafterKind:
    """Adds `kind` (an instance) to the registry; returns it. A second registration of
    the same name raises unless replace=True (re-importing a module is harmless: the
    same class registering again replaces itself)."""
    if not isinstance(kind, DrafterKind) or not kind.name:
        raise SpecjaxError(f"register: {kind!r} is not a named DrafterKind")
    if kind.objective not in ("ttt", "block"):
        raise SpecjaxError(f"drafter kind {kind.name}: objective {kind.objective!r}; use ttt "
                           "or block")
    with _lock:
        old = _KINDS.get(kind.name)
        if old is not None and not replace and type(old).__qualname__ != \
                type(kind).__qualname__:
            raise SpecjaxError(f"drafter kind {kind.name!r} is already registered")
        _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Removes a kind (tests)."""
    with _lock:
        _KINDS.pop(name, None)


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        _loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def kinds() -> tuple[str, ...]:
    """Names of the registered kinds: the built-in ones first, in registration order."""
    _load_builtins()
    builtin = [m.rsplit(".", 1)[1] for m in BUILTIN_MODULES]
    return tuple(sorted(_KINDS, key=lambda k: builtin.index(k) if k in builtin
                        else len(builtin)))  # stable: the rest in registration order


def get(name) -> DrafterKind:
    """The registered kind `name`; raises SpecjaxError for an unknown one."""
    _load_builtins()
    kind = _KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise SpecjaxError(f"drafter kind {name!r}; use one of {kinds()}")
    return kind


def is_kind(name) -> bool:
    _load_builtins()
    return isinstance(name, str) and name in _KINDS


def objective_kinds(objective: str) -> tuple[str, ...]:
    """The kinds that `objective` ("ttt" or "block") trains."""
    return tuple(k for k in kinds() if _KINDS[k].objective == objective)


def early_stop_kinds() -> tuple[str, ...]:
    """The kinds whose drafting stops early (--draft-stop)."""
    return tuple(k for k in kinds() if _KINDS[k].early_stop)


def setting_kinds(field: str) -> tuple[str, ...]:
    """The kinds that use the kind-only DrafterConfig field `field` (e.g. "context")."""
    return tuple(k for k in kinds() if field in _KINDS[k].settings)


__all__ = ["DrafterKind", "early_stop_kinds", "get", "is_kind", "kinds",
           "objective_kinds", "register", "setting_kinds", "unregister"]
