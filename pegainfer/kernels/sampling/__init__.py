"""Token selection on the GPU: greedy argmax, temperature / top-k / top-p / min-p sampling, and log-sum-exp.

The decode step is captured in a CUDA graph with sampling inside it, so every per-request knob lives in device
arrays (``SamplingBuffers``) that the engine refreshes before each replay; only the chosen token ids ``[B]`` int32
cross back to the host.  Logits are bf16 bits ``[B, V]`` (``B`` rows = sequences of the step, ``V`` = vocabulary;
a row-strided view is fine).

* ``reference`` -- a thread per row: what a draw means, stated plainly (the tests' oracle); the tuned sampler picks
  the same token
* ``sampler`` -- the tuned sampler (``sample``): threshold search, candidates in shared memory, split greedy rows
* ``one_pass`` -- ``argmax`` and ``logsumexp``, one pass over each row
* ``threshold`` -- ordered bf16 keys and the search step for the kept set's threshold
* ``gumbel`` -- the counter-based Gumbel noise of the draw (shared by ``sampler`` and ``reference``)
* ``rows`` -- walking a row with 16-byte loads and a visitor; ``block`` -- block-wide reductions of the sampler
* ``buffers`` -- ``SamplingBuffers``, the sampler's workspace, ``HeadArgmax`` (the LM head's greedy token)
* ``logprobs`` -- ``top_logprobs`` on the host
"""
from pegainfer.kernels.sampling.block import CANDIDATE_CAPACITY
from pegainfer.kernels.sampling.buffers import (GREEDY_BELOW, GREEDY_PARTS, MAX_HEAD_BLOCKS, HeadArgmax,
                                                SamplingBuffers, allocate_sample_workspace, sample_workspace_size,
                                                workspace_views)
from pegainfer.kernels.sampling.gumbel import GUMBEL_MAX
from pegainfer.kernels.sampling.logprobs import top_logprobs
from pegainfer.kernels.sampling.one_pass import ARGMAX_THREADS, argmax, argmax_kernel, logsumexp, logsumexp_kernel
from pegainfer.kernels.sampling.reference import (reference_argmax, reference_argmax_kernel, reference_logsumexp,
                                                  reference_logsumexp_kernel, reference_sample,
                                                  reference_sample_kernel)
from pegainfer.kernels.sampling.sampler import (EXACT_TOP_P_MARGIN, SAMPLE_THREADS, SAMPLE_THREADS_SIM, sample,
                                                sample_kernel)
from pegainfer.kernels.sampling.threshold import BUCKETS, KEY_FLOOR, PROBES

__all__ = ["ARGMAX_THREADS", "BUCKETS", "CANDIDATE_CAPACITY", "EXACT_TOP_P_MARGIN", "GREEDY_BELOW", "GREEDY_PARTS",
           "GUMBEL_MAX", "HeadArgmax", "KEY_FLOOR", "MAX_HEAD_BLOCKS", "PROBES", "SAMPLE_THREADS",
           "SAMPLE_THREADS_SIM", "SamplingBuffers", "allocate_sample_workspace", "argmax", "argmax_kernel",
           "logsumexp", "logsumexp_kernel", "reference_argmax", "reference_argmax_kernel", "reference_logsumexp",
           "reference_logsumexp_kernel", "reference_sample", "reference_sample_kernel", "sample", "sample_kernel",
           "sample_workspace_size", "top_logprobs", "workspace_views"]
