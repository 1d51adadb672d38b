"""One forward's ragged batch: every sequence's new tokens flattened, with the metadata the paged ops read.

Sequence b's new tokens are rows query_start[b]:query_start[b+1] of `tokens`; each sits at `positions[i]` of its
sequence and writes its k/v to `slot_mapping[i]` = page * page_size + offset of the paged cache
(webchat.model.kv_cache). Token i of sequence b attends causally to positions [0, positions[i]] of b, read through
block_tables[b]. Page 0 is never handed to a sequence: padding rows (CUDA graph buckets) write there and read nothing.
An image's slots (webchat.engine.images) come as `Placed` rows: rows `embed_rows` take `embeds` in place of their
token's embedding, and where an image's slots see each other both ways (Gemma 3), row i attends [0, key_ends[i]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Placed:
    """A sequence's new tokens that are an image's slots: their embedding rows, given; and where the image's slots see
    each other both ways, the end of the positions each new token attends (None: causal, positions[i] + 1)."""

    offsets: list[int]  # indices into the sequence's new tokens
    rows: torch.Tensor  # (len(offsets), dim) float32
    key_ends: list[int] | None = None  # one per new token


@dataclass
class HostRows:
    """A batch's indices as the Python lists make_batch built them, for a forward that reads them on the host (the CPU
    model's C++ step takes them as they are: no tensor is made for a step that needs none)."""

    tokens: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start: list[int]
    seq_lens: list[int]
    block_tables: list[int]  # (B * width) page ids, row by row
    width: int
    logit_rows: list[int]
    prompt_ends: list[int] | None
    embed_rows: list[int] | None = None  # rows whose embedding is given (Batch.embeds); None: none
    key_ends: list[int] | None = None  # per row, the end of the positions it attends; None: causal everywhere
    exact: list[bool] | None = None  # per sequence: its prompt rows at float32 whatever the precision (Batch.exact)


class Batch:
    """The tensors of a ragged batch (below). Built by make_batch, each is made from its HostRows when first read, on
    the batch's device; built from tensors (a CUDA graph's static batch), it has no rows."""

    tokens: torch.Tensor  # (T,) int64 token ids, sequence by sequence
    positions: torch.Tensor  # (T,) int64 position of each token in its sequence
    slot_mapping: torch.Tensor  # (T,) int64 cache slot of each token's k/v: page * page_size + offset
    query_start: torch.Tensor  # (B+1,) int32 row offsets: sequence b owns rows [query_start[b], query_start[b+1])
    seq_lens: torch.Tensor  # (B,) int32 tokens of b in the cache after this step's writes
    block_tables: torch.Tensor  # (B, max_pages) int32 page ids of each sequence, padded with 0
    logit_rows: torch.Tensor  # (R,) int64 rows of `tokens` whose logits the forward returns
    # (B,) int64, on the CPU whatever the device: b's rows at positions below prompt_ends[b] are its prompt's (the
    # CPU forward computes them as a GEMM, the same numbers however the prompt is chunked); None: no row is
    prompt_ends: torch.Tensor | None
    embed_rows: torch.Tensor | None  # (E,) int64 rows whose input is `embeds` (an image's slots), None: none
    key_ends: torch.Tensor | None  # (T,) int64 row i attends positions below key_ends[i]; None: positions[i] + 1

    TENSORS = ("tokens", "positions", "slot_mapping", "query_start", "seq_lens", "block_tables", "logit_rows",
               "prompt_ends", "embed_rows", "key_ends")

    def __init__(self, *, tokens: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None, query_start: torch.Tensor | None = None,
                 seq_lens: torch.Tensor | None = None, block_tables: torch.Tensor | None = None,
                 logit_rows: torch.Tensor | None = None, max_seq_len: int = 0,
                 prompt_ends: torch.Tensor | None = None, rows: HostRows | None = None,
                 device: torch.device | str = "cpu", embeds: torch.Tensor | None = None,
                 embed_rows: torch.Tensor | None = None, key_ends: torch.Tensor | None = None,
                 exact: list[bool] | None = None) -> None:
        given = {"tokens": tokens, "positions": positions, "slot_mapping": slot_mapping, "query_start": query_start,
                 "seq_lens": seq_lens, "block_tables": block_tables, "logit_rows": logit_rows}
        if rows is None:
            missing = [name for name, t in given.items() if t is None]
            if missing:
                raise ValueError(f"a batch without host rows needs every tensor; missing {', '.join(missing)}")
            for name, t in given.items():
                setattr(self, name, t)
            self.prompt_ends = prompt_ends
            self.embed_rows, self.key_ends = embed_rows, key_ends
        self.embeds = embeds  # (E, dim) float32: the embed_rows' inputs (after the embedding scale), or None
        self.max_seq_len = max_seq_len  # max(seq_lens), read on the host without a device sync
        self.rows, self.device = rows, device
        self.plan: object = None  # ops' per-batch precomputation, built once
        # per sequence (host bools), or None: b's prompt rows (positions below prompt_ends[b]) and their logit rows are
        # multiplied at float32 whatever the model's precision, its other rows at the model's (a prompt scored)
        self.exact = rows.exact if rows is not None else exact
        if self.exact is not None and len(self.exact) != self.num_seqs:
            raise ValueError(f"exact needs one flag per sequence ({self.num_seqs}), got {len(self.exact)}")

    def __getattr__(self, name: str) -> torch.Tensor | None:
        """A tensor not read before: made from the host rows now, and kept."""
        rows = self.__dict__.get("rows")
        if rows is None or name not in Batch.TENSORS:
            raise AttributeError(name)
        data = getattr(rows, name)  # HostRows names its lists as the tensors they become
        value: torch.Tensor | None
        if name == "prompt_ends":
            value = None if data is None else torch.tensor(data, dtype=torch.long)
        elif name in ("embed_rows", "key_ends"):
            value = None if data is None else torch.tensor(data, dtype=torch.long, device=self.device)
        else:
            dtype = torch.int32 if name in ("query_start", "seq_lens", "block_tables") else torch.long
            value = torch.tensor(data, dtype=dtype, device=self.device)
            if name == "block_tables":
                value = value.view(-1, rows.width)
        setattr(self, name, value)
        return value

    @property
    def num_tokens(self) -> int:
        return len(self.rows.tokens) if self.rows is not None else int(self.tokens.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.rows.seq_lens) if self.rows is not None else int(self.block_tables.shape[0])

    def exact_rows(self) -> torch.Tensor | None:
        """(T,) bool on the CPU: the rows `exact` puts at float32 (a flagged sequence's prompt rows), or None where
        there are none."""
        if self.exact is None or not any(self.exact) or self.prompt_ends is None:
            return None
        starts = self.rows.query_start if self.rows is not None else self.query_start.tolist()
        positions = self.rows.positions if self.rows is not None else self.positions.tolist()
        ends = self.prompt_ends.tolist()
        mask = [False] * self.num_tokens
        for b, flag in enumerate(self.exact):
            if flag:
                for t in range(starts[b], starts[b + 1]):
                    mask[t] = positions[t] < ends[b]
        return torch.tensor(mask) if any(mask) else None


def make_batch(seqs: list[tuple[list[int], int, list[int], list[int]]], page_size: int,
               device: torch.device | str = "cpu", prompt_ends: list[int] | None = None,
               placed: list[Placed | None] | None = None, exact: list[bool] | None = None) -> Batch:
    """A Batch from (new_tokens, start_position, pages, logit_offsets) per sequence.

    new_tokens sit at positions start_position.. of a sequence whose cache pages are `pages` (enough for
    start_position + len(new_tokens) tokens); logit_offsets index new_tokens (e.g. [-1] for the last, or all rows).
    prompt_ends: per sequence, how many of its first positions are its prompt (Batch.prompt_ends).
    placed: per sequence, its new tokens that are an image's slots (Placed), or None.
    exact: per sequence, whether its prompt rows run at float32 whatever the precision (Batch.exact), or None.
    """
    if prompt_ends is not None and len(prompt_ends) != len(seqs):
        raise ValueError(f"prompt_ends needs one value per sequence ({len(seqs)}), got {len(prompt_ends)}")
    if placed is not None and len(placed) != len(seqs):
        raise ValueError(f"placed needs one entry per sequence ({len(seqs)}), got {len(placed)}")
    if exact is not None and len(exact) != len(seqs):
        raise ValueError(f"exact needs one flag per sequence ({len(seqs)}), got {len(exact)}")
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

    # tensors only when read: each torch call costs ~10 us on a thread whose caches a forward has just swept, and the
    # CPU step (webchat.kernels.cpu.step) reads the lists (the default model's decode step is ~6 ms)
    host = HostRows(tokens=tokens, positions=positions, slot_mapping=slots, query_start=starts, seq_lens=lens,
                    block_tables=[p for table in tables for p in table], width=width, logit_rows=rows,
                    prompt_ends=None if prompt_ends is None else list(prompt_ends),
                    exact=None if exact is None or not any(exact) else list(exact))
    embeds = _place(host, starts, placed) if placed is not None and any(placed) else None
    return Batch(rows=host, max_seq_len=max(lens), device=device, embeds=embeds)


def _place(host: HostRows, starts: list[int], placed: list[Placed | None]) -> torch.Tensor | None:
    """The placed rows written into the host rows (embed_rows, key_ends); their embeddings, concatenated."""
    embed_rows: list[int] = []
    values: list[torch.Tensor] = []
    ends: list[int] | None = None
    for b, p in enumerate(placed):
        if p is None:
            continue
        n = starts[b + 1] - starts[b]
        if p.rows.shape[0] != len(p.offsets) or any(not 0 <= o < n for o in p.offsets):
            raise ValueError(f"sequence {b}: {len(p.offsets)} placed offsets within its {n} new tokens need as many "
                             f"rows, got offsets {p.offsets[:4]}... and {p.rows.shape[0]} rows")
        embed_rows += [starts[b] + o for o in p.offsets]
        values.append(p.rows)
        if p.key_ends is not None:
            if len(p.key_ends) != n:
                raise ValueError(f"sequence {b}: key_ends needs one value per new token ({n}), got {len(p.key_ends)}")
            if ends is None:
                ends = [pos + 1 for pos in host.positions]
            ends[starts[b] : starts[b + 1]] = p.key_ends
    host.embed_rows, host.key_ends = (embed_rows or None), ends
    return torch.cat(values) if embed_rows else None
