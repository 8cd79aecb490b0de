"""Token batches: synthetic (a random sparse Markov chain, so the loss has something to learn),
or text / jsonl files through a byte-level tokenizer, packed into fixed-length sequences.
Deterministic given the seed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from aurakernel.errors import UserError

BOS, EOS, BYTE_OFFSET = 0, 1, 2  # byte b is token b + 2


def byte_tokenize(text: str) -> list[int]:
    return [BOS] + [b + BYTE_OFFSET for b in text.encode("utf-8")] + [EOS]


def _documents(source: str, path: str) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"data file {p}: no such file")
    if source == "text":
        return [p.read_text(encoding="utf-8", errors="replace")]
    docs = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"data file {p}: line {n} is not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise UserError(f"data file {p}: line {n} has no string field 'text'")
        docs.append(rec["text"])
    return docs


class TokenBatches:
    """Yields (input_ids, labels), each [batch, seq_len]; labels are inputs shifted by one."""

    def __init__(self, source: str, path: str | None, seq_len: int, batch_size: int, vocab_size: int, seed: int):
        self.seq_len, self.batch_size, self.vocab_size = seq_len, batch_size, vocab_size
        self.g = torch.Generator().manual_seed(seed)
        if source == "synthetic":
            self.stream = None
            # each token has 4 likely successors: the loss can fall from ln(V) towards ln(4)
            self.successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=self.g)
        else:
            if vocab_size < 256 + BYTE_OFFSET:
                raise UserError(f"byte-level data needs vocab_size >= {256 + BYTE_OFFSET}, the model has {vocab_size}")
            tokens = [t for doc in _documents(source, path) for t in byte_tokenize(doc)]
            if len(tokens) < seq_len + 1:
                raise UserError(f"data file {path}: {len(tokens)} tokens, need at least seq_len + 1 = {seq_len + 1}")
            self.stream = torch.tensor(tokens)
            self.pos = 0

    def _synthetic_row(self) -> torch.Tensor:
        succ = self.successors.tolist()
        choices = torch.randint(0, 4, (self.seq_len,), generator=self.g).tolist()
        row = [int(torch.randint(0, self.vocab_size, (1,), generator=self.g))]
        for c in choices:
            row.append(succ[row[-1]][c])
        return torch.tensor(row)

    def _packed_row(self) -> torch.Tensor:
        n = self.seq_len + 1
        if self.pos + n > len(self.stream):
            self.pos = 0
        row = self.stream[self.pos: self.pos + n]
        self.pos += self.seq_len
        return row

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        make = self._synthetic_row if self.stream is None else self._packed_row
        rows = torch.stack([make() for _ in range(self.batch_size)])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
