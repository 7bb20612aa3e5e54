"""The backend dispatcher: which implementation runs a call.

Selection order: explicit ``backend=`` > ``use_backend(...)`` context > environment
(``QKERNELS_OPS`` > ``ASTR_BACKEND`` / ``QECDEC_BACKEND``) > the automatic chain (the first
available backend, in priority order cuda, flash, cpu, whose predicate matches the call).
Explicit, context and environment selections are strict: a backend that cannot take the call
raises ExplicitSelectionError.  Decisions are cached per call signature, so a repeated call pays
one dict lookup.  The environment is read at first use; ``reload_env()`` reads it again.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import itertools
import os
import warnings
from dataclasses import dataclass, field

from . import _C

BACKENDS = ("cuda", "flash", "cpu")
GRAPH_FAMILIES = ("fused_edge_features", "fused_norm_residual", "graph_norm_bce", "sparse_aggregate", "graph_plan",
                  "message_passing")
LLM_FAMILIES = ("attention", "rotary_emb", "linear", "swiglu", "rmsnorm")
FAMILIES = LLM_FAMILIES + GRAPH_FAMILIES
GROUPS = {"graph": GRAPH_FAMILIES, "llm": LLM_FAMILIES}
ENV_GROUPS = (("ASTR_BACKEND", LLM_FAMILIES), ("QECDEC_BACKEND", GRAPH_FAMILIES))
LEGACY_SPELLINGS = {"torch_native": "cpu", "pytorch": "cpu", "compiled": "cpu"}
# Family names before families were named after their op; still accepted, with a warning.
LEGACY_FAMILIES = {"edge_features": "fused_edge_features", "norm_residual": "fused_norm_residual",
                   "graph_bce": "graph_norm_bce", "rotary": "rotary_emb"}


def params(op):
    """The names of op's parameters, in order, from its C signature ("(row_ptr, col_idx, ...)")."""
    names = (p.split("=")[0].strip(" *") for p in getattr(_C, op).__text_signature__.strip("()").split(","))
    return [n for n in names if n]


# op name -> (family, position and name of the argument whose device/dtype/framework decide),
# from the C op table.
OPS = {op: (family, position, params(op)[position]) for op, (family, position) in _C.OPS.items()}

# The arguments an op updates in place besides out=, as ((position, name), ...), and the keyword
# argument that makes it do so (None: every call).  The staged cpu path copies them back, the torch
# operators' schemas mark them mutated, and qkernels.testing's references say what they end as.
WRITES = {
    "attn_paged_decode": ("new_k", ((1, "k_cache"), (2, "v_cache"))),
    "fused_add_rmsnorm": (None, ((1, "residual"),)),
    "rotary_kv_append": (None, ((5, "k_pool"), (6, "v_pool"))),
}


def written_args(op, kwargs):
    """((position, name), ...) of the arguments this call of op writes in place besides out=."""
    when, args = WRITES.get(op, (None, ()))
    return args if when is None or kwargs.get(when) is not None else ()


def _attention_axes(paged):
    def axes(args, kwargs):
        q = args[0] if args else kwargs.get("q")
        shape = getattr(q, "shape", None)  # a raw capsule has none: the kernel layer checks it
        return (("head_dim", int(shape[-1]) if shape else "unknown"), ("has_mask", kwargs.get("mask") is not None),
                ("paged", paged))

    return axes


# Axes a predicate needs beyond the deciding tensor's framework, device and dtype, read from the
# call's arguments: op -> fn(args, kwargs) -> ((name, value), ...).  They are part of the cache key.
CALL_AXES = {"attn_decode": _attention_axes(False), "attn_paged_decode": _attention_axes(True),
             "attn_prefill": _attention_axes(False), "attn_paged_prefill": _attention_axes(True)}

_DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "bool")


class ExplicitSelectionError(RuntimeError):
    """A backend chosen explicitly (argument, context or environment) cannot take the call."""


class FallbackWarning(UserWarning):
    """The cpu backend is running a call on device tensors by staging them through host memory."""


def _axes_from_code(code, framework):
    device = {1: "cpu", 2: "cuda"}.get(code >> 8, "unknown") if code >= 0 else "unknown"
    dtype = _DTYPES[code & 0xFF] if code >= 0 and (code & 0xFF) < len(_DTYPES) else "unknown"
    return {"framework": framework, "device": device, "dtype": dtype}


_framework_of_type = {}


def framework_name(x):
    """The framework a tensor belongs to: torch, numpy, jax, cupy, qkernels (our Tensor) or dlpack
    (a raw capsule); otherwise the top-level module of its type."""
    t = type(x)
    name = _framework_of_type.get(t)
    if name is None:
        mod = t.__module__.split(".")[0]
        name = "dlpack" if t.__name__ == "PyCapsule" else {"jaxlib": "jax"}.get(mod, mod)
        if len(_framework_of_type) < 256:
            _framework_of_type[t] = name
    return name


# Tensors that belong to no framework: they mix with any.
NEUTRAL_FRAMEWORKS = ("qkernels", "dlpack")


# ---- backends: availability and per-family predicates ---------------------------------------

def _req(description, test, failure=None):
    """A predicate term; a failing call is reported as `failure` (a string, or a function of the op name)
    when given, else "requires ...; got ..."."""
    return (description, test, failure)


_ON_CUDA = _req("inputs on a CUDA device", lambda a: a["device"] == "cuda")
_FLOAT32 = _req("dtype float32", lambda a: a["dtype"] == "float32")
_CUDA_FLOATS = _req("dtype float32, float16 or bfloat16", lambda a: a["dtype"] in ("float32", "float16", "bfloat16"))

# The flash_attn function each attention op calls (qkernels/_flash.py), and what it offers instead of
# a mask: named in the flash predicate's reasons.
_FLASH_CALLS = {
    "attn_decode": ("flash_attn_with_kvcache", "kv_lens is"),
    "attn_paged_decode": ("flash_attn_with_kvcache", "kv_lens is"),
    "attn_prefill": ("flash_attn_func", "is_causal is"),
    "attn_paged_prefill": ("flash_attn_func", "is_causal is"),
}

_PREDICATES = {
    "cuda": {
        "sparse_aggregate": [_ON_CUDA, _CUDA_FLOATS],
        "fused_edge_features": [_ON_CUDA, _CUDA_FLOATS],
        "fused_norm_residual": [_ON_CUDA, _CUDA_FLOATS],
        "graph_norm_bce": [_ON_CUDA, _CUDA_FLOATS],
        "message_passing": [_ON_CUDA, _FLOAT32],
    },
    "flash": {
        # flash_attn_with_kvcache (decode: contiguous [B, Lkv, Hkv, D] caches with cache_seqlens) and
        # flash_attn_func (prefill: dense [B, L, H, D]); neither takes a token pool or a mask (bool or
        # additive float)
        "attention": [
            _req("no token-pool paging", lambda a: not a.get("paged"),
                 lambda op: f"token-pool paging (req_to_token) is not supported by {_FLASH_CALLS[op][0]}"),
            _req("torch tensors", lambda a: a["framework"] == "torch"),
            _req("inputs on a CUDA device", lambda a: a["device"] == "cuda"),
            _req("dtype float16 or bfloat16", lambda a: a["dtype"] in ("float16", "bfloat16")),
            _req("head_dim <= 256 and a multiple of 8",
                 lambda a: isinstance(a.get("head_dim"), int) and a["head_dim"] <= 256 and a["head_dim"] % 8 == 0),
            _req("no mask", lambda a: not a.get("has_mask"),
                 lambda op: "a mask (bool or float) is not supported by {} ({})".format(*_FLASH_CALLS[op])),
        ],
    },
    "cpu": {family: [_FLOAT32] for family in GRAPH_FAMILIES},
}

# The dense LLM ops: our CUDA kernels take bfloat16/float16, the C CPU kernels float32 too.
_HALVES = _req("dtype float16 or bfloat16", lambda a: a["dtype"] in ("float16", "bfloat16"))
for _family in ("rotary_emb", "linear", "swiglu"):
    _PREDICATES["cuda"][_family] = [_ON_CUDA, _HALVES]
    _PREDICATES["cpu"][_family] = [_CUDA_FLOATS]

# Attention: our CUDA kernels take bfloat16/float16 at head_dim 32/64/128/256 (an unknown head_dim,
# from a raw capsule, is left to the kernel layer to check); the C CPU kernels float32 too, any D.
_PREDICATES["cuda"]["attention"] = [
    _ON_CUDA,
    _req("dtype float16 or bfloat16", lambda a: a["dtype"] in ("float16", "bfloat16")),
    _req("head_dim 32, 64, 128 or 256", lambda a: a.get("head_dim") in (32, 64, 128, 256, "unknown")),
]
_PREDICATES["cpu"]["attention"] = [_CUDA_FLOATS]

# RMSNorm: float32, float16 and bfloat16 kernels on both devices.
_PREDICATES["cuda"]["rmsnorm"] = [_ON_CUDA, _CUDA_FLOATS]
_PREDICATES["cpu"]["rmsnorm"] = [_CUDA_FLOATS]

# The plan ops: their deciding argument is the graph's index tensor.
_INDICES = _req("index dtype int32 or int64", lambda a: a["dtype"] in ("int32", "int64"))
_PREDICATES["cuda"]["graph_plan"] = [_ON_CUDA, _INDICES]
_PREDICATES["cpu"]["graph_plan"] = [_INDICES]

# Families or ops whose CUDA kernels are built but not enabled yet: until their GPU tests have passed
# (tests/test_cuda_<op>.py runs them as if enabled), the cuda backend declines them, so GPU tensors are
# staged through the cpu kernels (with a FallbackWarning) and backend="cuda" refuses with the reason.
CUDA_PENDING = {}

_availability = {}
_describe = _C.describe


def backend_available(name):
    """(available, why not) for a backend; probed once per process."""
    if name not in _availability:
        if name == "cuda":
            ci = _C.cuda_info()
            _availability[name] = (ci["available"], ci["reason"])
        elif name == "flash":
            found = importlib.util.find_spec("flash_attn") is not None
            _availability[name] = (found, "" if found else "the flash_attn package is not installed")
        else:
            _availability[name] = (True, "")
    return _availability[name]


def _check(backend, family, axes, op):
    """None when backend can take op's call, else the reason it cannot."""
    ok, why = backend_available(backend)
    if not ok:
        return f"unavailable: {why}"
    preds = _PREDICATES[backend].get(family)
    if preds is None:
        return f"no {backend} kernel for family '{family}'"
    if backend == "cuda" and (CUDA_PENDING.get(op) or CUDA_PENDING.get(family)):
        return f"the {op} CUDA kernels are built but not enabled until their GPU tests pass"
    for description, test, *failure in preds:
        if not test(axes):
            if failure and failure[0]:
                return failure[0](op) if callable(failure[0]) else failure[0]
            got = " ".join(str(v) if k in ("framework", "device", "dtype") else f"{k}={v}" for k, v in axes.items())
            return f"requires {description}; got {got}"
    return None


# ---- selection sources ----------------------------------------------------------------------

_NO_CONTEXT = ({}, 0)  # (family -> backend, token): the token keys the decision cache
_ctx = contextvars.ContextVar("qkernels_backend", default=_NO_CONTEXT)
_ctx_tokens = itertools.count(1)
_env_cache = None
_cache = {}
_warned = set()


def _warn_once(key, message, stacklevel):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, DeprecationWarning if key[0] == "family" else UserWarning, stacklevel=stacklevel + 1)


def _normalize(value, source, stacklevel=4):
    v = str(value).strip().lower()
    if v in LEGACY_SPELLINGS:
        _warn_once(("backend", source, v), f"{source}={value!r} is a legacy spelling; it selects the 'cpu' backend "
                   f"(qkernels' C kernels)", stacklevel)
        return "cpu"
    if v not in BACKENDS + ("auto",):
        raise ValueError(f"{source} must be one of cuda, flash, cpu, auto (or legacy torch_native, pytorch, "
                         f"compiled), got {value!r}")
    return v


def _families(key, source, stacklevel=4):
    """The families a name selects: a group (graph, llm), a family, or a family's legacy name."""
    if key in GROUPS:
        return GROUPS[key]
    if key in FAMILIES:
        return (key,)
    if key in LEGACY_FAMILIES:
        new = LEGACY_FAMILIES[key]
        _warn_once(("family", source, key), f"{source}: family {key!r} is now spelled {new!r}", stacklevel)
        return (new,)
    raise ValueError(f"{source}: unknown family {key!r}; expected one of {', '.join(FAMILIES)}, or the groups "
                     f"graph and llm")


def _parse_env():
    """family -> (backend, origin), or (None, message) for a family whose variable is bad: the
    error is raised by that family's calls only."""
    sel = {}
    for var, families in ENV_GROUPS:
        raw = os.environ.get(var)
        if raw:
            try:
                choice = (_normalize(raw, var), f"env {var}")
            except ValueError as e:
                choice = (None, str(e))
            for f in families:
                sel[f] = choice
    raw = os.environ.get("QKERNELS_OPS")
    if raw:
        for item in raw.split(","):
            if not item.strip():
                continue
            fam, sep, val = item.partition("=")
            if not sep:
                raise ValueError(f"QKERNELS_OPS entries must be name=backend with a family or the groups graph and "
                                 f"llm; got {item.strip()!r}")
            for f in _families(fam.strip(), "QKERNELS_OPS"):
                try:
                    sel[f] = (_normalize(val, f"QKERNELS_OPS[{fam.strip()}]"), "env QKERNELS_OPS")
                except ValueError as e:
                    sel[f] = (None, str(e))
    return sel


def _env():
    global _env_cache
    if _env_cache is None:
        _env_cache = _parse_env()
    return _env_cache


# The direct path (csrc/dispatch.c): a public op called with no backend= and no use_backend()
# context, whose tensors all have a type in direct_types (torch, read through the DLPack C
# exchange API), runs the C op at once when direct_plans[op] holds the call's key
# (_C._direct_key: device, dtype, last dimension, mask or not).  The Python path (ops.py) records a
# key there through record_direct() once choose() decided such a call runs unstaged on our kernels
# and returns the caller's tensor as is.
direct_plans = {op: {} for op in OPS}
direct_types = set()


def reload_env():
    """Read ASTR_BACKEND, QECDEC_BACKEND and QKERNELS_OPS again (they are read once, at first use)."""
    global _env_cache
    _env_cache = None
    _cache.clear()
    for plans in direct_plans.values():
        plans.clear()
    try:
        _env()
    except ValueError:
        pass  # reported at the next dispatched call, naming the variable


@contextlib.contextmanager
def use_backend(backend=None, /, **families):
    """Select backends inside a ``with`` block (nestable; local to the thread or asyncio task).

    ``use_backend("cpu")`` sets every family; ``use_backend(sparse_aggregate="cuda", llm="flash")``
    sets families or the groups ``graph`` and ``llm``.
    """
    mapping = dict(_ctx.get()[0])
    if backend is not None:
        b = _normalize(backend, "use_backend", stacklevel=4)
        mapping.update({f: b for f in FAMILIES})
    for key, value in families.items():
        targets = _families(key, "use_backend", stacklevel=4)
        b = _normalize(value, f"use_backend({key}=...)", stacklevel=4)
        mapping.update({f: b for f in targets})
    token = _ctx.set((mapping, next(_ctx_tokens)))
    try:
        yield
    finally:
        _ctx.reset(token)


# ---- decisions ------------------------------------------------------------------------------

@dataclass
class Decision:
    """The dispatcher's decision for one call: printable (``print(qkernels.explain(...))``)."""

    op: str
    family: str
    axes: dict
    candidates: list = field(default_factory=list)  # (backend, "MATCH" | "reject" | "unavailable", why)
    requested: str = "auto"
    origin: str = "chain"
    winner: str | None = None
    staged: bool = False
    error: str | None = None

    def __str__(self):
        axes = " ".join(f"{k}={v}" for k, v in self.axes.items())
        lines = [f"qkernels: {self.op} (family {self.family})", f"  axes: {axes}"]
        for name, status, why in self.candidates:
            lines.append(f"  {name:<6} {status}" + (f": {why}" if why else ""))
        if self.winner:
            note = ", stages through host memory" if self.staged else ""
            lines.append(f"  -> {self.winner} (origin: {self.origin}"
                         + (f", requested {self.requested}" if self.origin != "chain" else "") + f"{note})")
        else:
            lines.append(f"  -> no backend: {self.error}")
        return "\n".join(lines)

    __repr__ = __str__


def _to_kernel_layer(d, axes):
    """The backend where the data lives, for a call no backend takes: its kernel layer names the
    argument at fault.  Notes that in d.error."""
    d.error = "no backend matches; the call goes to the kernel layer, which reports the problem"
    return "cuda" if axes["device"] == "cuda" and backend_available("cuda")[0] else "cpu"


def _decide(op, x, explicit, extra=()):
    axes = _axes_from_code(_C.describe(x), framework_name(x))
    axes.update(extra)
    return decide_axes(op, axes, explicit)


def decide_axes(op, axes, explicit):
    """The Decision for a call described by its axes (framework, device, dtype and CALL_AXES)."""
    family = OPS[op][0]
    d = Decision(op=op, family=family, axes=axes)
    for b in BACKENDS:
        ok, why = backend_available(b)
        if not ok:
            d.candidates.append((b, "unavailable", why))
            continue
        reason = _check(b, family, axes, op)
        d.candidates.append((b, "MATCH", "") if reason is None else (b, "reject", reason))
    if explicit is not None:
        d.requested, d.origin = _normalize(explicit, f"{op}: backend="), "explicit"
    else:
        ctx = _ctx.get()[0]
        if family in ctx:
            d.requested, d.origin = ctx[family], "context"
        else:
            env = _env().get(family)
            if env and env[0] is None:
                raise ValueError(env[1])
            if env:
                d.requested, d.origin = env
    if d.requested != "auto":
        reason = _check(d.requested, family, axes, op)
        if reason is not None and not any(status == "MATCH" for _, status, _ in d.candidates):
            # No backend takes the call (a dtype nobody supports, say): as in the chain, the kernel
            # layer where the data lives reports it, naming the argument.
            reason, d.requested = None, _to_kernel_layer(d, axes)
        if reason is not None:
            d.error = (f"{op}: backend '{d.requested}' selected by {d.origin} cannot run family '{family}' "
                       f"for this call: {reason}")
            return d
        d.winner = d.requested
    else:
        d.origin = "chain"
        d.winner = next((b for b, status, _ in d.candidates if status == "MATCH"), None)
        if d.winner is None:
            # Nothing matches (a dtype no backend takes, say): run where the data lives so the
            # kernel layer raises its precise TypeError/ValueError naming the argument.
            d.winner = _to_kernel_layer(d, axes)
    d.staged = d.winner == "cpu" and axes["device"] == "cuda"
    if d.staged and axes["framework"] in NEUTRAL_FRAMEWORKS:
        # Our Tensor and raw capsules cannot be staged (no framework to copy them): they run where
        # they live, and the kernel layer says what is missing there.
        d.winner, d.staged = "cuda", False
    return d


def resolve(op, *args, backend=None, **kwargs):
    """The decision for ``op(*args, **kwargs)`` as data (a Decision)."""
    if op not in OPS:
        raise ValueError(f"resolve: unknown op {op!r}; expected one of {', '.join(OPS)}")
    _, idx, arg = OPS[op]
    x = args[idx] if len(args) > idx else kwargs.get(arg)
    if x is None:
        raise TypeError(f"resolve: {op} needs its argument {arg!r} to decide")
    axes = CALL_AXES.get(op)
    return _decide(op, x, backend, axes(args, kwargs) if axes else ())


def explain(op, *args, backend=None, **kwargs):
    """Like resolve(); the returned Decision prints as a table: ``print(qkernels.explain(...))``."""
    return resolve(op, *args, backend=backend, **kwargs)


class Plan(tuple):
    """What a call does: (backend, staged, direct).  direct: _C takes the arguments as they are and
    returns the caller's framework itself (torch through the DLPack C exchange API)."""

    __slots__ = ()
    backend = property(lambda self: self[0])
    staged = property(lambda self: self[1])
    direct = property(lambda self: self[2])


def configure(**settings):
    """Change _C's debug settings (see _C._configure) and forget cached plans that depend on them."""
    old = _C._configure(**settings)
    _cache.clear()
    direct_types.clear()
    for plans in direct_plans.values():
        plans.clear()
    return old


def _is_direct(x, staged):
    if staged or framework_name(x) != "torch":
        return False
    return hasattr(type(x), "__dlpack_c_exchange_api__") and _C._configure()["use_exchange_api"]


def record_direct(op, x, has_mask, tensors=()):
    """Let the C entry point run calls like this one itself (see direct_plans).  tensors: the call's
    other tensor arguments, all of x's framework (so nn.Parameter weights beside a torch.Tensor x
    keep the call on the direct path)."""
    plans = direct_plans[op]
    if len(plans) > 4096:
        plans.clear()
    plans[_C._direct_key(x, has_mask)] = True
    for t in tensors:
        if len(direct_types) < 64 and hasattr(type(t), "__dlpack_c_exchange_api__"):
            direct_types.add(type(t))


def choose(op, x, explicit, extra=()):
    """The Plan for a call whose deciding tensor is x (extra: the CALL_AXES values)."""
    key = (op, type(x), _describe(x), explicit, _ctx.get()[1], extra)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    d = _decide(op, x, explicit, extra)
    if d.winner is None:
        raise ExplicitSelectionError(d.error)
    hit = Plan((d.winner, d.staged, d.winner != "flash" and _is_direct(x, d.staged)))
    if hit.direct:
        direct_types.add(type(x))
    if len(_cache) > 4096:
        _cache.clear()
    _cache[key] = hit
    return hit
