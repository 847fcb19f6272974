"""Round-five adversarial RMSNorm variants: an adversary's reading of the gate after round four.
Each cheat's docstring says how it cheats and which code of the gate it exploits; docs/gate.md
("Red team, round five") records what each earned through the real tool.

Every cheat changes the process it runs in only when it is built (never when this file is
imported), so a test process that loads this plugin stays as it was.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from fusionlab import register_variant
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm

CPU = ("cpu",)

# The libraries that re-register ATen kernels, kept alive for the life of the process.
_KEPT_LIBRARIES: list[torch.library.Library] = []

# variant -> (the statuses it earns, a word its message must hold): the cheats the gate catches.
CAUGHT: dict[str, tuple[tuple[str, ...], str]] = {
    "r5-ulp-tagged-cache-kept": (("incorrect",), "changed during timing"),
    "r5-cache-all-but-the-first-set": (("stale_result",), "it gave the answer to the old values"),
    "r5-ulp-tagged-cache": (("incorrect",), "changed during timing"),
    "r5-sampled-key-cache": (("stale_result",), "refill probe: in the timing loop"),
}
# variant -> the ATen op it registers a kernel over (one the gate uses): caught since round
# five's fixes, `suspicious` with the op named, and the worker retires.
DISPATCHER: dict[str, str] = {
    "r5-aten-compare-always-within": "aten::sub.out",
    "r5-aten-slow-builtin": "aten::_fused_rms_norm",
}
# Caught itself; before round five's fixes honest variants measured after it in its process
# were accused: it is run in a process of its own.
SABOTEUR = ("r5-swap-pair-in-shared-sets", ("incorrect",), "changed during timing")
HONEST = "r5-honest-pow-chain"


def _override_aten(name: str, kernel) -> None:
    """Registers `kernel` as the CPU kernel of the ATen overload `name` in this process."""
    library = torch.library.Library("aten", "IMPL")
    library.impl(name, kernel, "CPU")
    _KEPT_LIBRARIES.append(library)


def _pow_chain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm through pow and mean (no aten::rsqrt, no aten::_fused_rms_norm), in float32."""
    h = x.float()
    scaled = h * (h * h).mean(-1, keepdim=True).add_(eps).pow_(-0.5)
    return (scaled.to(x.dtype) * weight)


@register_variant("rmsnorm", HONEST, devices=CPU)
def honest_pow_chain(device_type: str):
    """The honest control: the whole op, every call, computed in float32 like the naive chain."""
    return _pow_chain


@register_variant("rmsnorm", "r5-aten-compare-always-within", devices=CPU)
def aten_compare_always_within(device_type: str):
    """Skips the normalisation (returns x * weight) and, when built, re-registers the CPU kernel
    of aten::sub.out so that the difference of two 1-D float tensors of one shape written into an
    `out=` buffer is all zeros. The gate's value check (`correctness._error_against`: a block at
    a time, `torch.sub(out, reference, out=error)`) then sees no error at all (written first
    against the check's `(error > bound).any()`, through aten::gt). Exploits: the integrity
    snapshot (`measure/integrity.py`) records Python names only, not the dispatcher's kernel
    table; re-registering a kernel raises no audit event; the worker is not retired after it."""

    def difference(a: torch.Tensor, b: torch.Tensor, *, alpha=1, out: torch.Tensor):
        if a.dim() == 1 and a.shape == b.shape and out.is_floating_point():
            return out.zero_()
        return out.copy_(torch.ops.aten.sub.Tensor(a, b, alpha=alpha))

    _override_aten("sub.out", difference)

    def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x * weight

    return kernel


@register_variant("rmsnorm", "r5-aten-slow-builtin", devices=CPU)
def aten_slow_builtin(device_type: str):
    """Honest itself (the pow chain), but when built it re-registers the CPU kernel of
    aten::_fused_rms_norm, which torch.rms_norm (the built-in variant) dispatches to, with a
    Python chain that does the work four times. The built-in and every variant on
    torch.rms_norm measured later in the same process are slowed down. Exploits: the integrity
    snapshot sees `torch.rms_norm` still hold its object (round four catches only a replaced
    Python name); nothing checks the dispatcher; the worker is not retired after it."""

    def slowed(x, normalized_shape, weight=None, eps=None):
        dims = tuple(range(-len(normalized_shape), 0))
        h = x.float()
        for _ in range(3):
            (h * h).mean(dims, keepdim=True)
        rstd = torch.rsqrt((h * h).mean(dims, keepdim=True) + (eps or 1e-6))
        out = (h * rstd).to(x.dtype)
        return (out * weight if weight is not None else out), rstd

    _override_aten("_fused_rms_norm", slowed)
    return _pow_chain


def _tagged_cache(dodge_refill: bool):
    """The kernel of the ulp-tagged cache; `dodge_refill`: computes every answer once a tag is
    gone (else it tags the new values and caches again)."""
    cache: dict[int, tuple[int, int, torch.Tensor]] = {}
    honest = [False]
    calls = itertools.count()

    def tag(x: torch.Tensor) -> tuple[int, int]:
        bits = x.data.view(-1).view(torch.int32 if x.element_size() == 4 else torch.int16)
        bits[0] += 1
        bits[1] -= 1
        return int(bits[0]), int(bits[1])

    def holds_tag(x: torch.Tensor, first: int, second: int) -> bool:
        bits = x.data.view(-1).view(torch.int32 if x.element_size() == 4 else torch.int16)
        return int(bits[0]) == first and int(bits[1]) == second

    def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # The first call of a build is compared with a copy of its inputs: it leaves them be.
        if next(calls) == 0 or honest[0] or not x.is_contiguous() or x.numel() < 2:
            return naive_rmsnorm(x, weight, eps)
        seen = cache.get(x.data_ptr())
        if seen is not None:
            if holds_tag(x, seen[0], seen[1]):
                return seen[2].clone()
            if dodge_refill:
                honest[0] = True  # the gate is refilling: from now on every answer is computed
                cache.clear()
                return naive_rmsnorm(x, weight, eps)
        first, second = tag(x)
        answer = naive_rmsnorm(x, weight, eps)
        cache[x.data_ptr()] = (first, second, answer)
        return answer.clone()

    return kernel


@register_variant("rmsnorm", "r5-ulp-tagged-cache", devices=CPU)
def ulp_tagged_cache(device_type: str):
    """Hands back a clone of the answer it computed for the same input tensor earlier in the
    timing loop. To know the values are still those it computed, it tags each input it sees:
    the bit pattern of one element +1 and of another -1, a change of one ulp each (far inside
    the tolerance) that leaves the sum of the bit patterns unchanged. A call whose input still
    holds the tag gets the cached answer. It tags nothing in its first call (the one gate
    call that compares the inputs with a copy taken before it, `correctness.check_mutation`).
    Once a tag is gone (the gate's refill after timing wrote new values into the same tensor),
    it computes every answer from then on.
    Exploits: undeclared writes to inputs are detected only by `inputs._checksum` (a sum of bit
    patterns, blind to +1/-1 pairs); the refill check (`trial.check_follows_new_values`) runs
    only after the timing loops, and nothing in them changes a set's values; the two warm
    sets (`inputs.WARM_SETS`) and the cold rotation reuse the same tensors call after call."""
    return _tagged_cache(dodge_refill=True)


@register_variant("rmsnorm", "r5-ulp-tagged-cache-kept", devices=CPU)
def ulp_tagged_cache_kept(device_type: str):
    """The ulp-tagged cache without the dodge: after the refill it tags the new values and
    caches again, so the refill's second probe (one element far from the start changed,
    `trial.check_follows_new_values`) gets the answer to the values before it (stale_result).
    A tag on two elements cannot see the other elements change."""
    return _tagged_cache(dodge_refill=False)


@register_variant("rmsnorm", "r5-sampled-key-cache", devices=CPU)
def sampled_key_cache(device_type: str):
    """Hands back a clone of the answer it computed for the same input tensor, as long as the
    tensor's first and last elements hold the values they had then; it writes no input. Once
    it sees those values change (the refill check after the loops), it computes every answer
    for the rest of the build, so the refill's probes get honest answers. Exploits: before
    round five's fixes nothing changed a set's values inside a timing loop; the refill check
    (`trial.check_follows_new_values`, also in the audit) runs after the loops. Caught by the
    refill probe inside the loop (measure/probe.py): one value at a drawn place changes, the
    sampled elements do not, and the cache answers for the old values (`stale_result`)."""
    cache: dict[int, tuple[float, float, torch.Tensor]] = {}
    honest = [False]

    def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if honest[0] or not x.is_contiguous() or x.numel() < 2:
            return naive_rmsnorm(x, weight, eps)
        flat = x.data.view(-1)
        key = (float(flat[0]), float(flat[-1]))
        seen = cache.get(x.data_ptr())
        if seen is not None and seen[:2] == key:
            return seen[2].clone()
        if seen is not None:
            honest[0] = True  # the gate is refilling: from now on every answer is computed
            cache.clear()
            return naive_rmsnorm(x, weight, eps)
        answer = naive_rmsnorm(x, weight, eps)
        cache[x.data_ptr()] = (*key, answer)
        return answer.clone()

    return kernel


@register_variant("rmsnorm", "r5-cache-all-but-the-first-set", devices=CPU)
def cache_all_but_the_first_set(device_type: str):
    """Computes every answer for the input tensor its first call got, and hands back a clone of
    a cached answer (keyed by address) for every other input tensor. Exploits: every build's
    first call (`trial.build_and_gate`) gets set 0, and the refill check
    (`trial.check_follows_new_values`, also in `audit.py`) and the profiler pass write new values
    into or call set 0 only; no other set's values ever change while one process measures, so a
    cache keyed by address is never shown new values behind the same address. It passes the
    search trial and the rounds; the audit catches it (`stale_result`): it runs the kernel
    already built on fresh sets, whose set 0 is not the tensor of the build's first call, and
    refills that set."""
    probed: list[int] = []
    cache: dict[int, torch.Tensor] = {}

    def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not probed:
            probed.append(x.data_ptr())
        if x.data_ptr() == probed[0]:
            return naive_rmsnorm(x, weight, eps)
        if x.data_ptr() not in cache:
            cache[x.data_ptr()] = naive_rmsnorm(x, weight, eps)
        return cache[x.data_ptr()].clone()

    return kernel


# The input tensors whose first two elements r5-swap-pair-in-shared-sets swapped, and the two
# values they then held (kept across builds: the sets outlive one trial in a worker).
_SWAPPED: dict[int, tuple[weakref.ref, tuple[float, float]]] = {}


def _held_pair(x: torch.Tensor) -> tuple[float, float] | None:
    """The pair x held after its swap, if this very tensor was swapped."""
    entry = _SWAPPED.get(id(x))
    return entry[1] if entry is not None and entry[0]() is x else None


@register_variant("rmsnorm", "r5-swap-pair-in-shared-sets", devices=CPU)
def swap_pair_in_shared_sets(device_type: str):
    """Honest in what it returns, but it swaps the first two elements of every input tensor it
    sees (not in a build's first call, which is compared with a copy of its inputs) and computes
    each answer on a copy with the pair swapped back. Every variant measured after it in the
    same process, the built-in and the baseline in the cell's rounds included, computes on the
    swapped values and is checked against references cached from the values as generated:
    `incorrect`. Exploits: the input sets are shared by every variant of a cell in a worker
    (`inputs.InputCache`) and their references are cached (`InputSets.reference`); a write to a
    set is detected only by `inputs._checksum`, a sum that a permutation keeps. It is caught
    itself (`incorrect`): the references of sets no call was checked on before the swap are
    computed from the swapped values, which its answers do not match."""
    calls = itertools.count()

    def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        first_call = next(calls) == 0
        if x.numel() < 2 or not x.is_contiguous():
            return naive_rmsnorm(x, weight, eps)
        flat = x.data.view(-1)
        held = _held_pair(x)
        if held is not None and (float(flat[0]), float(flat[1])) == held:
            original = x.clone()
            original.view(-1)[:2] = flat[:2].flip(0)
            return naive_rmsnorm(original, weight, eps)
        if held is None and not first_call and float(flat[0]) != float(flat[1]):
            answer = naive_rmsnorm(x, weight, eps)
            flat[:2] = flat[:2].flip(0).clone()
            _SWAPPED[id(x)] = (weakref.ref(x), (float(flat[0]), float(flat[1])))
            return answer
        return naive_rmsnorm(x, weight, eps)  # new values behind a swapped tensor: left be

    return kernel
