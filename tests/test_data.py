"""The trainer's data pipeline: CPT packing, SFT loss masking, order, resume, rank sharding, errors."""

import json

import pytest
import torch
import yaml

from aurakernel.errors import UserError
from trainer.config import load_config
from trainer.data import EOS, IGNORE, ByteTokenizer, HFTokenizer, TokenBatches, encode_chat, load_tokenizer

from conftest import TINY

WORDS = ["user", "assistant", "system", "hello", "hi", "there", "how", "are", "you", "fine", "thanks",
         "be", "brief", "a", "b", "c", "d", "e", "f", "g"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(tmp_path, chat_template=True):
    """A word-level tokenizer saved like a checkpoint's: one token per word, so expected ids are obvious."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template:
        fast.chat_template = TEMPLATE
    d = tmp_path / ("tok" if chat_template else "tok_plain")
    fast.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def write_jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return str(path)


def take(batches, n):
    return [next(batches) for _ in range(n)]


# ---------------------------------------------------------------- tokenizers

def test_load_tokenizer_picks_checkpoint_or_byte_fallback(tmp_path, tok):
    assert isinstance(tok, HFTokenizer) and tok.has_chat_template
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    assert tok.encode("hello there") == [9, 11]
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)  # a directory without tokenizer files
    assert load_tokenizer(None).encode("A") == [ord("A") + 2]
    with pytest.raises(UserError, match="no such directory"):
        load_tokenizer(tmp_path / "missing")


# ---------------------------------------------------------------- CPT

def test_cpt_packs_documents_with_bos_eos_into_contiguous_windows(tmp_path, tok_dir):
    docs = ["a b c", "d e", "f g a b", "c d e f g"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    b = TokenBatches("jsonl", path, seq_len=4, batch_size=2, vocab_size=64, seed=0, tokenizer=tok_dir)
    t = b.tokenizer
    stream = b._stream(0)
    # epoch 0's order, each document framed by BOS ... EOS
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(0)).tolist()
    expect = [i for k in order for i in [t.bos_id] + t.encode(docs[k]) + [t.eos_id]]
    assert stream.tolist() == expect
    assert b.rows_per_epoch == (len(expect) - 1) // 4
    rows = [torch.cat([x, y[:, -1:]], dim=1) for x, y in take(b, 2)]
    windows = torch.cat(rows).tolist()
    for k, w in enumerate(windows):  # stride seq_len: window k starts where window k-1's targets end
        assert w == expect[4 * k: 4 * k + 5]
    x, y = next(TokenBatches("jsonl", path, 4, 2, 64, 0, tokenizer=tok_dir))
    assert (x[:, 1:] == y[:, :-1]).all() and (y != IGNORE).all()


def test_cpt_text_file_and_directory_with_byte_tokens(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    x, y = next(TokenBatches("text", str(tmp_path / "a.txt"), 6, 1, 512, 0))
    assert x[0].tolist() == [0] + [c + 2 for c in b"hello"] and y[0, -1] == EOS
    (tmp_path / "docs").mkdir()
    for name in ("one", "two"):
        (tmp_path / "docs" / f"{name}.txt").write_text(name)
    b = TokenBatches("text", str(tmp_path / "docs"), 4, 1, 512, 0)
    assert sorted(b._stream(0).tolist()) == sorted(
        [0, 1, 0, 1] + [c + 2 for c in b"one"] + [c + 2 for c in b"two"])


# ---------------------------------------------------------------- SFT

def supervised(y):
    """Target ids whose label is kept, per row."""
    return [row[row != IGNORE].tolist() for row in y]


def test_sft_chat_template_supervises_exactly_the_assistant_turns(tmp_path, tok_dir, tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "how are you"},
            {"role": "assistant", "content": "fine thanks"}]
    path = write_jsonl(tmp_path / "s.jsonl", [{"messages": msgs}])
    x, y = next(TokenBatches("sft", path, 40, 1, 64, 0, tokenizer=tok_dir))
    end = tok.encode("<|im_end|>")
    assert supervised(y) == [tok.encode("hi there") + end + tok.encode("fine thanks") + end]
    # the inputs are the whole rendered chat, then padding whose labels are ignored
    full = tok.encode(tok.render_chat(msgs))
    assert x[0, :len(full)].tolist() == full
    assert (x[0, len(full):] == tok.pad_id).all() and (y[0, len(full) - 1:] == IGNORE).all()


def test_sft_prompt_response_without_template_uses_role_tags(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "Q?", "response": "A!"}])
    x, y = next(TokenBatches("sft", path, 32, 1, 512, 0))  # byte-level: no chat template
    text = bytes(t - 2 for t in x[0].tolist() if t >= 2).decode()
    assert text == "<|user|>\nQ?\n<|assistant|>\nA!"
    assert supervised(y) == [[c + 2 for c in b"A!"] + [EOS]]


def test_sft_hf_tokenizer_without_template_and_truncation(tmp_path):
    plain = load_tokenizer(make_tokenizer(tmp_path, chat_template=False))
    ids, sup = encode_chat(plain, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}])
    assert [i for i, s in zip(ids, sup) if s] == plain.encode("hi") + [plain.eos_id]
    # a long response is cut to seq_len + 1 tokens and keeps its supervised prefix: here the 9th
    # token (after BOS, "<| user |>", "hello", "<| assistant |>") is the one response token left
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "hello", "response": " ".join(["a"] * 50)}])
    x, y = next(TokenBatches("sft", path, 8, 1, 64, 0, tokenizer=plain))
    assert x.shape == (1, 8) and y[0].tolist() == [IGNORE] * 7 + plain.encode("a")


def test_sft_rows_pad_one_example_each(tmp_path, tok_dir):
    recs = [{"prompt": "hello", "response": w} for w in ["a", "b c", "d e f"]]
    b = TokenBatches("sft", write_jsonl(tmp_path / "s.jsonl", recs), 16, 3, 64, 0, tokenizer=tok_dir)
    x, y = next(b)
    got = sorted(tuple(r[r != IGNORE].tolist()[:-1]) for r in y)  # drop <|im_end|>
    assert got == sorted(tuple(b.tokenizer.encode(r["response"])) for r in recs)


# ---------------------------------------------------------------- order, resume, ranks

@pytest.fixture
def cpt_path(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", [{"text": f"document number {i} " * (1 + i % 3)} for i in range(30)])


@pytest.fixture
def sft_path(tmp_path):
    return write_jsonl(tmp_path / "s.jsonl", [{"prompt": f"q{i}", "response": f"answer {i}"} for i in range(11)])


def same(a, b):
    return len(a) == len(b) and all((x1 == x2).all() and (y1 == y2).all() for (x1, y1), (x2, y2) in zip(a, b))


@pytest.mark.parametrize("source", ["jsonl", "sft", "synthetic"])
def test_order_is_deterministic_by_seed_and_reshuffled_per_epoch(source, cpt_path, sft_path):
    path = {"jsonl": cpt_path, "sft": sft_path, "synthetic": None}[source]
    make = lambda seed: TokenBatches(source, path, 32, 4, 512, seed)  # noqa: E731
    a, b, c = take(make(1), 8), take(make(1), 8), take(make(2), 8)
    assert same(a, b) and not same(a, c)
    if source == "sft":  # 11 examples: epoch 1 visits the same rows in another order
        rows = [tuple(r.tolist()) for x, _ in a for r in x]
        assert sorted(rows[:11]) == sorted(rows[11:22]) and rows[:11] != rows[11:22]


@pytest.mark.parametrize("source", ["jsonl", "sft", "synthetic"])
def test_resume_restores_the_exact_next_batches(source, cpt_path, sft_path, tmp_path):
    path = {"jsonl": cpt_path, "sft": sft_path, "synthetic": None}[source]
    first = TokenBatches(source, path, 32, 3, 512, seed=7)
    take(first, 5)  # crosses an epoch boundary for sft
    torch.save(first.state_dict(), tmp_path / "state.pt")
    expected = take(first, 6)
    fresh = TokenBatches(source, path, 32, 3, 512, seed=7)
    fresh.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert same(take(fresh, 6), expected)


@pytest.mark.parametrize("source", ["jsonl", "sft", "synthetic"])
def test_ranks_split_the_global_batch(source, cpt_path, sft_path):
    path = {"jsonl": cpt_path, "sft": sft_path, "synthetic": None}[source]
    world = 3
    single = take(TokenBatches(source, path, 40, 2 * world, 512, seed=4), 4)
    ranks = [take(TokenBatches(source, path, 40, 2, 512, seed=4, rank=r, world_size=world), 4) for r in range(world)]
    for step, (x, y) in enumerate(single):
        assert (torch.cat([ranks[r][step][0] for r in range(world)]) == x).all()
        assert (torch.cat([ranks[r][step][1] for r in range(world)]) == y).all()
    # resuming works with a different world size: the position counts global rows
    rank1 = TokenBatches(source, path, 40, 2, 512, seed=4, rank=1, world_size=world)
    take(rank1, 2)
    solo = TokenBatches(source, path, 40, 2 * world, 512, seed=4)
    solo.load_state_dict(rank1.state_dict())
    assert same(take(solo, 2), single[2:])


def test_state_from_other_data_is_refused(cpt_path, sft_path):
    state = TokenBatches("jsonl", cpt_path, 32, 2, 512, 0).state_dict()
    with pytest.raises(UserError, match="data state: saved for seed 0"):
        TokenBatches("jsonl", cpt_path, 32, 2, 512, 1).load_state_dict(state)
    with pytest.raises(UserError, match="saved for source 'jsonl'"):
        TokenBatches("sft", sft_path, 32, 2, 512, 0).load_state_dict(state)


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("source,lines,fragment", [
    ("jsonl", ['{"text": "ok"}', '{"text": broken}'], "s.jsonl: line 2 is not valid JSON"),
    ("jsonl", ['{"text": "ok"}', '{"body": "x"}'], "line 2 has no string field 'text'"),
    ("jsonl", ["", "  "], "empty dataset"),
    ("sft", ['{"prompt": "q"}'], "line 1: an SFT record needs 'messages' or string fields 'prompt' and 'response'"),
    ("sft", ['{"messages": []}'], "line 1: 'messages' must be a non-empty list"),
    ("sft", ['{"messages": [{"role": "user"}]}'], "line 1: message 1 needs a 'role' and a string 'content'"),
    ("sft", ['{"prompt": "q", "response": "a"}', '{"messages": [{"role": "bot", "content": "x"}]}'],
     "line 2: message 1 has unknown role 'bot': accepted are system, user, assistant, tool"),
    ("sft", ['{"messages": [{"role": "user", "content": "x"}]}'], "line 1: no assistant message"),
    ("sft", [json.dumps({"prompt": "hello " * 40, "response": "hi"})],
     "line 1: no response tokens left after truncation"),
    ("sft", [], "no examples \\(empty dataset\\)"),
])
def test_data_errors_name_the_file_and_line(tmp_path, tok_dir, source, lines, fragment):
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=fragment):
        TokenBatches(source, str(path), 16, 1, 64, 0, tokenizer=tok_dir)


def test_setup_errors(tmp_path, tok_dir):
    with pytest.raises(UserError, match="no such file"):
        TokenBatches("sft", str(tmp_path / "none.jsonl"), 16, 1, 512, 0)
    (tmp_path / "a.txt").write_text("short")
    with pytest.raises(UserError, match="need at least seq_len \\+ 1"):
        TokenBatches("text", str(tmp_path / "a.txt"), 64, 1, 512, 0)
    with pytest.raises(UserError, match="byte-level data needs vocab_size >= 258"):
        TokenBatches("text", str(tmp_path / "a.txt"), 2, 1, 100, 0)
    with pytest.raises(UserError, match="has 26 tokens, the model's vocab_size is 20"):
        TokenBatches("text", str(tmp_path / "a.txt"), 2, 1, 20, 0, tokenizer=tok_dir)
    with pytest.raises(UserError, match="rank 2 is outside world_size 2"):
        TokenBatches("synthetic", None, 8, 1, 64, 0, rank=2, world_size=2)
    # a template that is not prefix-consistent cannot locate assistant turns
    bad = load_tokenizer(tok_dir)
    bad.tok.chat_template = "{% for m in messages|reverse %}{{ m.content }} {% endfor %}"
    bad.has_chat_template = True
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "hello", "response": "hi"}])
    with pytest.raises(UserError, match="s.jsonl: line 1: the chat template .* prefix-consistent"):
        TokenBatches("sft", path, 16, 1, 64, 0, tokenizer=bad)


def test_config_accepts_sft_and_tokenizer(tmp_path):
    raw = yaml.safe_load(open(TINY))
    raw["data"].update(source="sft", path="s.jsonl", tokenizer="ckpt/")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.data.source, cfg.data.tokenizer) == ("sft", "ckpt/")
    raw["data"]["tokenizer"] = 3
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match="data.tokenizer must be a directory path or null"):
        load_config(tmp_path / "c.yaml")
