"""Log-probabilities on the host: the chosen token's and the top-N of one row, from its logits and ``lse``."""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.primitives import from_bf16_bits


def top_logprobs(logits_row, lse: float, token_id: int, n: int):
    """Log-probabilities of the raw distribution from one row's logits on the host (f32, or bf16 bits as uint16)
    and its ``lse`` (from ``logsumexp``): returns ``(logprob of token_id, [(id, logprob)] × n)``, the n most
    likely tokens in decreasing order (ties → smaller id first)."""
    row = np.asarray(logits_row)
    if row.dtype == np.uint16:
        row = from_bf16_bits(row)
    row = row.astype(np.float32, copy=False).reshape(-1)
    lse = np.float32(lse)
    chosen = float(row[token_id] - lse)
    n = int(min(max(n, 0), row.shape[0]))
    if n == 0:
        return chosen, []
    nth = np.partition(row, row.shape[0] - n)[row.shape[0] - n]       # the n-th largest logit
    above = np.flatnonzero(row > nth)
    top = np.concatenate([above, np.flatnonzero(row == nth)[: n - above.shape[0]]])
    top = top[np.lexsort((top, -row[top]))]
    return chosen, [(int(i), float(row[i] - lse)) for i in top]
