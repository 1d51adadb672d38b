"""One forward's ragged batch: every sequence's new tokens flattened, with the metadata the paged ops read.

Sequence b's new tokens are rows query_start[b]:query_start[b+1] of `tokens`; each sits at `positions[i]` of its
sequence and writes its k/v to `slot_mapping[i]` = page * page_size + offset of the paged cache
(webchat.model.kv_cache). Token i of sequence b attends causally to positions [0, positions[i]] of b, read through
block_tables[b]. Page 0 is never handed to a sequence: padding rows (CUDA graph buckets) write there and read nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    tokens: torch.Tensor  # (T,) int64 token ids, sequence by sequence
    positions: torch.Tensor  # (T,) int64 position of each token in its sequence
    slot_mapping: torch.Tensor  # (T,) int64 cache slot of each token's k/v: page * page_size + offset
    query_start: torch.Tensor  # (B+1,) int32 row offsets: sequence b owns rows [query_start[b], query_start[b+1])
    seq_lens: torch.Tensor  # (B,) int32 tokens of b in the cache after this step's writes
    block_tables: torch.Tensor  # (B, max_pages) int32 page ids of each sequence, padded with 0
    logit_rows: torch.Tensor  # (R,) int64 rows of `tokens` whose logits the forward returns
    max_seq_len: int = 0  # max(seq_lens), read on the host without a device sync
    # (B,) int64, on the CPU whatever the device: b's rows at positions below prompt_ends[b] are its prompt's (the
    # CPU forward computes them as a GEMM, the same numbers however the prompt is chunked); None: no row is
    prompt_ends: torch.Tensor | None = None
    plan: object = field(default=None, repr=False, compare=False)  # ops' per-batch precomputation, built once

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])


def make_batch(seqs: list[tuple[list[int], int, list[int], list[int]]], page_size: int,
               device: torch.device | str = "cpu", prompt_ends: list[int] | None = None) -> Batch:
    """A Batch from (new_tokens, start_position, pages, logit_offsets) per sequence.

    new_tokens sit at positions start_position.. of a sequence whose cache pages are `pages` (enough for
    start_position + len(new_tokens) tokens); logit_offsets index new_tokens (e.g. [-1] for the last, or all rows).
    prompt_ends: per sequence, how many of its first positions are its prompt (Batch.prompt_ends).
    """
    if prompt_ends is not None and len(prompt_ends) != len(seqs):
        raise ValueError(f"prompt_ends needs one value per sequence ({len(seqs)}), got {len(prompt_ends)}")
    if not seqs:
        raise ValueError("a batch needs at least one sequence, got none")
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    lens: list[int] = []
    rows: list[int] = []
    width = max(len(pages) for _, _, pages, _ in seqs)
    tables = []
    for new, start, pages, logit_offsets in seqs:
        end = start + len(new)
        if not new:
            raise ValueError("each sequence in a batch needs at least one new token")
        if end > len(pages) * page_size:
            raise ValueError(f"{end} positions need {-(-end // page_size)} pages of {page_size}, got {len(pages)}")
        base = len(tokens)
        tokens.extend(new)
        for pos in range(start, end):
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        rows.extend(base + (o % len(new)) for o in logit_offsets)
        starts.append(len(tokens))
        lens.append(end)
        tables.append(pages + [0] * (width - len(pages)))

    def t(x: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=device)

    return Batch(tokens=t(tokens, torch.long), positions=t(positions, torch.long), slot_mapping=t(slots, torch.long),
                 query_start=t(starts, torch.int32), seq_lens=t(lens, torch.int32),
                 block_tables=t(tables, torch.int32), logit_rows=t(rows, torch.long), max_seq_len=max(lens),
                 prompt_ends=None if prompt_ends is None else torch.tensor(prompt_ends, dtype=torch.long))
