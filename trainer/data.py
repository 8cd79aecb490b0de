"""Token batches for the trainer.

Sources:
  synthetic  a random sparse Markov chain (the loss has something to learn, no files needed)
  text       continued pre-training (CPT) on a .txt file, or a directory of .txt files; each file is
             one document
  jsonl      CPT on a .jsonl file, one {"text": ...} document per line
  sft        supervised fine-tuning on a .jsonl file, one example per line:
             {"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": ..., "response": ...}

Every batch is (input_ids, labels), each [batch, seq_len] int64, with labels already shifted:
labels[t] is the token after input_ids[t], or -100 where no loss is taken.

CPT: documents are tokenized as [BOS] text [EOS] (BOS only when the tokenizer has one), concatenated
in a per-epoch shuffled document order and cut into windows of seq_len + 1 tokens with stride
seq_len, so consecutive windows share one token and every token of the stream is a target exactly
once. The stream's tail shorter than a window is dropped (it differs per epoch, as the order does).

SFT: one example per row, right-padded with the pad token to seq_len + 1 tokens. Examples are not
packed: the trainer passes no attention mask or position ids, so packed examples would attend to
each other; with causal attention, padding after an example cannot influence it, and its labels are
-100. Only assistant / response tokens are supervised (a chat template's end-of-turn tokens that
follow an assistant message count as part of it). Over-long examples are truncated from the right
to seq_len + 1 tokens; one left with no supervised token is an error naming its line.

Order: row i of the infinite row stream is row i % N of epoch i // N (N rows per epoch); epoch e
shuffles documents / examples with torch.Generator().manual_seed(seed + e). Synthetic rows come
from one sequential generator seeded with `seed`. Batches are drawn from global batches of
batch_size * world_size rows; rank r takes the contiguous block of rows
[r * batch_size, (r + 1) * batch_size), so concatenating the ranks' batches in rank order gives the
single-process batch of batch_size * world_size rows for the same seed.

Resume: state_dict() holds the global row position (and, for synthetic, the generator state). It
is the same on every rank, so one saved copy restores all ranks, even with another world size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from aurakernel.errors import UserError

BOS, EOS, BYTE_OFFSET = 0, 1, 2  # byte b is token b + 2
IGNORE = -100
ROLES = ("system", "user", "assistant", "tool")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
SOURCES = ("synthetic", "text", "jsonl", "sft")
STATE_VERSION = 1


def byte_tokenize(text: str) -> list[int]:
    return [BOS] + [b + BYTE_OFFSET for b in text.encode("utf-8")] + [EOS]


# ---------------------------------------------------------------- tokenizers

class ByteTokenizer:
    """UTF-8 bytes shifted by two; BOS 0, EOS 1 (also the pad token: padding is never a target)."""

    name = "byte-level"
    bos_id, eos_id, pad_id = BOS, EOS, EOS
    size = 256 + BYTE_OFFSET
    has_chat_template = False

    def encode(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        raise TypeError("the byte-level tokenizer has no chat template")


class HFTokenizer:
    """A transformers tokenizer behind the same small interface. encode() adds no special tokens:
    BOS/EOS placement is the data pipeline's (CPT) or the chat template's (SFT) decision."""

    def __init__(self, tok, name: str):
        self.tok, self.name = tok, name
        if tok.eos_token_id is None:
            raise UserError(f"tokenizer {name}: has no eos_token (documents and turns need an end token)")
        self.bos_id = tok.bos_token_id
        self.eos_id = tok.eos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.size = len(tok)
        self.has_chat_template = bool(getattr(tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # one call: fast tokenizers encode a batch in parallel
        return self.tok(texts, add_special_tokens=False)["input_ids"] if texts else []

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    """The tokenizer of a checkpoint directory (transformers AutoTokenizer) when it holds tokenizer
    files, else the byte-level fallback."""
    if model_dir is None:
        return ByteTokenizer()
    d = Path(model_dir)
    if not d.is_dir():
        raise UserError(f"tokenizer {d}: no such directory")
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        return ByteTokenizer()
    from transformers import AutoTokenizer  # slow import: only when a real tokenizer is used

    try:
        tok = AutoTokenizer.from_pretrained(str(d))
    except Exception as exc:  # transformers raises many types; the user needs the one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"tokenizer {d}: could not be loaded ({first})") from None
    return HFTokenizer(tok, str(d))


# ---------------------------------------------------------------- reading files

def _jsonl(p: Path):
    """(line number, record) for each non-blank line of a .jsonl file."""
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"data file {p}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"data file {p}: line {n} is not valid JSON ({exc.msg})") from None
        yield n, rec


def _utf8(p: Path) -> str:
    """A text data file, refused unless it is UTF-8 (decoding with replacement would train on U+FFFD)."""
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"data file {p}: not UTF-8 ({exc.reason} at byte {exc.start}): text data must be UTF-8") from None


def _documents(source: str, path: str | None) -> list[str]:
    if not path:
        raise UserError(f"data.source {source} needs data.path")
    p = Path(path)
    if source == "text" and p.is_dir():
        files = sorted(p.rglob("*.txt"))
        if not files:
            raise UserError(f"data directory {p}: no .txt files (empty dataset)")
        docs = [_utf8(f) for f in files]
    elif not p.is_file():
        raise UserError(f"data file {p}: no such file")
    elif source == "text":
        docs = [_utf8(p)]
    else:
        docs = []
        for n, rec in _jsonl(p):
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise UserError(f"data file {p}: line {n} has no string field 'text'")
            docs.append(rec["text"])
    if not any(d.strip() for d in docs):
        raise UserError(f"data file {p}: no documents with text (empty dataset)")
    return docs


def _messages(rec, where: str) -> list[dict]:
    """The record as a validated chat: {"messages": [...]} or {"prompt", "response"}."""
    if isinstance(rec, dict) and "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise UserError(f"{where}: 'messages' must be a non-empty list")
        for k, m in enumerate(msgs, 1):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
                raise UserError(f"{where}: message {k} needs a 'role' and a string 'content'")
            if m["role"] not in ROLES:
                raise UserError(f"{where}: message {k} has unknown role {m['role']!r}: accepted are {', '.join(ROLES)}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise UserError(f"{where}: no assistant message (nothing to train on)")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and isinstance(rec.get("response"), str):
        return [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["response"]}]
    raise UserError(f"{where}: an SFT record needs 'messages' or string fields 'prompt' and 'response'")


# ---------------------------------------------------------------- SFT encoding

def _template_segments(tok: HFTokenizer, msgs: list[dict], where: str) -> list[tuple[str, bool]]:
    """Split the chat template's rendering into (text, supervised) segments. Assistant message i
    spans from the end of render(msgs[:i], generation prompt) to the end of render(msgs[:i + 1]),
    so its end-of-turn tokens are supervised and the role header is not."""
    try:
        full = tok.render_chat(msgs)
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            head = tok.render_chat(msgs[:i], add_generation_prompt=True)
            turn = tok.render_chat(msgs[: i + 1])
            if not (full.startswith(turn) and turn.startswith(head)) or (spans and len(head) < spans[-1][1]):
                raise UserError(f"{where}: the chat template of {tok.name} does not render the conversation "
                                f"as a prefix-consistent sequence, so assistant turns cannot be located")
            spans.append((len(head), len(turn)))
    except UserError:
        raise
    except Exception as exc:  # jinja errors, e.g. a template demanding alternating roles
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{where}: the chat template of {tok.name} failed ({first})") from None
    segments, cursor = [], 0
    for a, b in spans:
        segments += [(full[cursor:a], False), (full[a:b], True)]
        cursor = b
    segments.append((full[cursor:], False))
    return [(s, sup) for s, sup in segments if s]


def encode_chat(tok: Tokenizer, msgs: list[dict], where: str = "chat") -> tuple[list[int], list[bool]]:
    """Token ids and a per-token supervised flag for a conversation.

    With a chat template, segments of its rendering are encoded separately (so the split between
    supervised and not falls exactly on a token boundary). Without one the format is
        [BOS] <|role|>\\n content \\n ...   and an assistant turn is  <|assistant|>\\n content [EOS]
    where only an assistant's content and its EOS are supervised."""
    ids, sup = [], []

    def add(tokens: list[int], supervised: bool):
        ids.extend(tokens)
        sup.extend([supervised] * len(tokens))

    if tok.has_chat_template:
        for text, supervised in _template_segments(tok, msgs, where):
            add(tok.encode(text), supervised)
        return ids, sup
    if tok.bos_id is not None:
        add([tok.bos_id], False)
    for m in msgs:
        add(tok.encode(f"<|{m['role']}|>\n"), False)
        if m["role"] == "assistant":
            add(tok.encode(m["content"]) + [tok.eos_id], True)
        else:
            add(tok.encode(m["content"] + "\n"), False)
    return ids, sup


# ---------------------------------------------------------------- batches

@dataclass
class _Sft:
    ids: list[torch.Tensor]   # per example, truncated to seq_len + 1
    sup: list[torch.Tensor]   # bool, same shapes


class TokenBatches:
    """Infinite iterator of (input_ids, labels), each [batch_size, seq_len]; see the module doc.

    tokenizer: a Tokenizer, a checkpoint/tokenizer directory, or None for the byte-level one.
    rank / world_size: this process's share of each global batch (contiguous row blocks)."""

    def __init__(self, source: str, path: str | None, seq_len: int, batch_size: int, vocab_size: int, seed: int,
                 *, tokenizer: Tokenizer | str | Path | None = None, rank: int = 0, world_size: int = 1):
        if source not in SOURCES:
            raise UserError(f"data.source {source!r}: accepted are {', '.join(SOURCES)}")
        if seq_len < 1 or batch_size < 1:
            raise UserError(f"data: seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(f"data: rank {rank} is outside world_size {world_size}")
        self.source, self.path = source, path
        self.seq_len, self.batch_size, self.vocab_size, self.seed = seq_len, batch_size, vocab_size, seed
        self.rank, self.world_size = rank, world_size
        self.row = 0  # global rows consumed by all ranks together: the whole resumable position
        self._epochs: dict[int, torch.Tensor] = {}  # CPT: epoch -> token stream; SFT: epoch -> order
        if source == "synthetic":
            self.g = torch.Generator().manual_seed(seed)
            # each token has 4 likely successors: the loss can fall from ln(V) towards ln(4)
            self.successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=self.g).tolist()
            self.rows_per_epoch, self.fingerprint = None, f"synthetic:{vocab_size}"
            return
        tok = tokenizer if isinstance(tokenizer, ByteTokenizer | HFTokenizer) else load_tokenizer(tokenizer)
        if tok.size > vocab_size:
            if isinstance(tok, ByteTokenizer):
                raise UserError(f"byte-level data needs vocab_size >= {tok.size}, the model has {vocab_size}")
            raise UserError(f"tokenizer {tok.name} has {tok.size} tokens, the model's vocab_size is {vocab_size}")
        self.tokenizer = tok
        digest = hashlib.blake2b(f"{source}:{seq_len}:{tok.name}".encode(), digest_size=16)
        if source == "sft":
            self._sft = self._load_sft(Path(path) if path else None, digest)
            self.rows_per_epoch = len(self._sft.ids)
        else:
            docs = [torch.tensor(([tok.bos_id] if tok.bos_id is not None else []) + ids + [tok.eos_id])
                    for ids in tok.encode_batch(_documents(source, path))]
            total = sum(len(d) for d in docs)
            if total < seq_len + 1:
                raise UserError(f"data file {path}: {total} tokens, need at least seq_len + 1 = {seq_len + 1}")
            for d in docs:
                digest.update(d.numpy().tobytes())
            self._docs = docs
            self.rows_per_epoch = (total - 1) // seq_len
        self.fingerprint = digest.hexdigest()

    @classmethod
    def from_config(cls, data, vocab_size: int, seed: int, *, rank: int = 0, world_size: int = 1) -> TokenBatches:
        """From a trainer.config.DataConfig."""
        return cls(data.source, data.path, data.seq_len, data.batch_size, vocab_size, seed,
                   tokenizer=data.tokenizer, rank=rank, world_size=world_size)

    def _load_sft(self, p: Path | None, digest) -> _Sft:
        if p is None:
            raise UserError("data.source sft needs data.path")
        if not p.is_file():
            raise UserError(f"data file {p}: no such file")
        out = _Sft([], [])
        n_tokens = self.seq_len + 1
        for n, rec in _jsonl(p):
            where = f"data file {p}: line {n}"
            ids, sup = encode_chat(self.tokenizer, _messages(rec, where), where)
            if not any(sup[1:n_tokens]):  # the first token is never a target
                raise UserError(f"{where}: no response tokens left after truncation to seq_len + 1 = {n_tokens} "
                                f"tokens (the example has {len(ids)}); raise data.seq_len or shorten it")
            ids, sup = ids[:n_tokens], sup[:n_tokens]
            t = torch.tensor(ids)
            digest.update(t.numpy().tobytes())
            out.ids.append(t)
            out.sup.append(torch.tensor(sup))
        if not out.ids:
            raise UserError(f"data file {p}: no examples (empty dataset)")
        return out

    # -- order

    def _order(self, epoch: int) -> torch.Tensor:
        n = len(self._sft.ids) if self.source == "sft" else len(self._docs)
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))

    def _stream(self, epoch: int) -> torch.Tensor:
        """The epoch's CPT token stream; kept for the current and the next epoch only."""
        if epoch not in self._epochs:
            self._epochs = {e: s for e, s in self._epochs.items() if e >= epoch - 1}
            self._epochs[epoch] = torch.cat([self._docs[i] for i in self._order(epoch).tolist()])
        return self._epochs[epoch]

    def _row(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Global row i: seq_len + 1 tokens and, for SFT, which of them are supervised."""
        epoch, k = divmod(i, self.rows_per_epoch)
        if self.source == "sft":
            if epoch not in self._epochs:
                self._epochs = {epoch: self._order(epoch)}
            j = int(self._epochs[epoch][k])
            ids, sup = self._sft.ids[j], self._sft.sup[j]
            pad = self.seq_len + 1 - len(ids)
            return (torch.cat([ids, ids.new_full((pad,), self.tokenizer.pad_id)]),
                    torch.cat([sup, sup.new_zeros(pad)]))
        start = k * self.seq_len
        return self._stream(epoch)[start: start + self.seq_len + 1], None

    def _synthetic_row(self) -> torch.Tensor:
        succ = self.successors
        choices = torch.randint(0, 4, (self.seq_len,), generator=self.g).tolist()
        row = [int(torch.randint(0, self.vocab_size, (1,), generator=self.g))]
        for c in choices:
            row.append(succ[row[-1]][c])
        return torch.tensor(row)

    # -- iteration

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.row + self.rank * self.batch_size
        if self.source == "synthetic":
            # one sequential generator: every rank draws the whole global batch and keeps its block
            rows = [self._synthetic_row() for _ in range(self.batch_size * self.world_size)]
            rows = rows[self.rank * self.batch_size: (self.rank + 1) * self.batch_size]
            masks = [None] * len(rows)
        else:
            rows, masks = zip(*(self._row(first + k) for k in range(self.batch_size)))
        self.row += self.batch_size * self.world_size
        tokens = torch.stack(rows)
        labels = tokens[:, 1:].clone()
        if masks[0] is not None:
            labels[~torch.stack(masks)[:, 1:]] = IGNORE
        return tokens[:, :-1].contiguous(), labels

    @property
    def epoch(self) -> int:
        """Epochs started so far (0-based); always 0 for synthetic data, which has no epochs."""
        return self.row // self.rows_per_epoch if self.rows_per_epoch else 0

    # -- resume

    def state_dict(self) -> dict:
        """The position after the last batch taken; the same on every rank."""
        state = {"version": STATE_VERSION, "source": self.source, "seed": self.seed, "seq_len": self.seq_len,
                 "fingerprint": self.fingerprint, "row": self.row}
        if self.source == "synthetic":
            state["rng"] = self.g.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the loader that wrote `state` stopped (same data and seed; the
        batch size and world size may differ: the position counts global rows)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise UserError(f"data state: not a version-{STATE_VERSION} TokenBatches state")
        for key in ("source", "seed", "seq_len", "fingerprint"):
            if state.get(key) != getattr(self, key):
                raise UserError(f"data state: saved for {key} {state.get(key)!r}, this loader has "
                                f"{getattr(self, key)!r} (resume needs the same data, tokenizer and seed)")
        self.row = int(state["row"])
        if self.source == "synthetic":
            self.g.set_state(state["rng"])
