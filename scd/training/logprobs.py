"""Each completion token's logprob and the entropy at its position, from the final hidden states, a chunk of
tokens at a time: full-vocabulary logits never exist for more than one chunk.

The loss needs one number per token (its logprob under the truncated sampling distribution, and the
entropy there), but the plain path materialises ``[rows, length, vocab]`` logits, turns them to fp32 and
keeps them, and their log-softmax, alive through backward: several GB per step at a 150k vocabulary.  Here
only the completion positions are projected, ``chunk_tokens`` at a time, each chunk under activation
checkpointing, so backward recomputes its logits instead of keeping them: the extra memory is
O(chunk × vocab), whatever the step's size.  The numbers are the plain path's (``full_token_logprobs``).

The entropy is measured on every step but is in the loss only with ``trainer.entropy_coef`` set.  Without
it, the entropy is computed with no graph: a graph that backward never walks would keep each chunk's
recomputed ``[chunk, vocab]`` intermediates (checkpointing frees a recomputed tensor only when backward
uses it) until the step ends.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from scd.model.sampling import Sampling

# "auto": chunks of about this many bytes of fp32 logits.
AUTO_CHUNK_BYTES = 256 << 20


def chunk_tokens_for(vocab_size: int, configured: int) -> int:
    """``trainer.logprob_chunk_tokens``, 0 read as about ``AUTO_CHUNK_BYTES`` of fp32 logits a chunk."""
    return configured or max(64, AUTO_CHUNK_BYTES // (4 * vocab_size))


def _chunk(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, sampling: Sampling,
           entropy_in_loss: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logp = sampling.logprobs(head(hidden).float())
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_in_loss and torch.is_grad_enabled()):
        # Tokens outside the truncated set have probability 0 and add nothing (0 x -inf would be NaN).
        entropy = -(logp.exp() * logp.masked_fill(logp.isinf(), 0.0)).sum(-1)
    return chosen, entropy


def token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, sampling: Sampling,
                   chunk_tokens: int, *, entropy_in_loss: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``targets``' logprobs and the entropies, each ``[tokens]``, for ``hidden`` ``[tokens, width]``: the
    hidden state at the position before each target.  The entropies carry a gradient only if
    ``entropy_in_loss``."""
    chosen, entropy = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        lp, ent = checkpoint(_chunk, hidden[part], targets[part], head, sampling, entropy_in_loss,
                             use_reentrant=False)
        chosen.append(lp)
        entropy.append(ent)
    return torch.cat(chosen), torch.cat(entropy)


def full_token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module,
                        sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The same numbers in one piece: the reference ``token_logprobs`` is checked against."""
    return _chunk(hidden, targets, head, sampling, entropy_in_loss=True)
