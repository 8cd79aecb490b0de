import json

import pytest
import yaml

from aurakernel.errors import UserError
from trainer.config import load_config
from trainer.data import TokenBatches, byte_tokenize
from trainer.metrics import attention_flops_per_token, parameter_counts
from trainer.model import build_model
from trainer.train import train

from conftest import TINY


def write_config(tmp_path, **sections):
    base = yaml.safe_load(open(TINY))
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def test_tiny_config_has_every_v4_feature():
    cfg = load_config(TINY)
    model = build_model(cfg.model, seed=0)
    c = model.config
    assert "compressed_sparse_attention" in c.layer_types and "heavily_compressed_attention" in c.layer_types
    assert c.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert "hash_moe" in c.mlp_layer_types and c.hc_mult == 4
    hash_router = model.model.layers[0].mlp.gate
    # hash tables get distinct experts per token (transformers initialises them to zeros)
    assert all(len(set(row.tolist())) == c.num_experts_per_tok for row in hash_router.tid2eid[:50])


@pytest.mark.parametrize("section,values,fragment", [
    ("train", {"dtype": "int4"}, "train.dtype"),
    ("train", {"lr": "fast"}, "must be a number"),
    ("data", {"source": "s3"}, "data.source"),
    ("data", {"source": "text"}, "needs data.path"),
    ("data", {"batchsize": 3}, "unknown key(s) batchsize"),
    ("model", {"hc_mult": 0, "layer_types": ["bogus"] * 4}, "model config rejected"),
])
def test_bad_config_is_one_clear_error(tmp_path, section, values, fragment):
    path = write_config(tmp_path, **{section: values})
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        cfg = load_config(path)
        build_model(cfg.model, 0)


# every numeric setting: values out of its range (each of which trained wrong, or failed late, before)
OUT_OF_RANGE = {
    ("train", "lr"): [-1, 0, float("nan"), "abc", None, True],
    ("train", "min_lr"): [-1e-4, 1.0],            # above lr
    ("train", "warmup_steps"): [-5, 2.5],
    ("train", "weight_decay"): [-0.1, float("inf")],
    ("train", "grad_clip"): [-1, 0],
    ("train", "betas"): [5, "abc", [0.9], [0.9, 1.0], [-0.1, 0.9], [0.9, "x"]],
    ("train", "seed"): [-1, 1.5],
    ("train", "steps"): [0, 2.5],
    ("train", "grad_accum"): [0],
    ("train", "max_bad_steps"): [0],
    ("train", "checkpoint_every"): [-1],
    ("train", "indexer_kl_weight"): [-1],
    ("data", "seq_len"): [0, 2.5, None, "1e8"],
    ("data", "batch_size"): [0, -2, 1.5],
}


@pytest.mark.parametrize("section,key", list(OUT_OF_RANGE))
def test_every_numeric_setting_refuses_out_of_range_values_in_one_line(tmp_path, section, key):
    for value in OUT_OF_RANGE[section, key]:
        path = write_config(tmp_path, **{section: {key: value}})
        with pytest.raises(UserError) as exc:
            load_config(path)
        message = str(exc.value)
        assert f"{section}.{key}" in message and "\n" not in message, message


def test_in_range_settings_load_and_grad_clip_null_means_no_clipping(tmp_path):
    cfg = load_config(write_config(tmp_path, train={"grad_clip": None, "warmup_steps": 0, "betas": [0.0, 0.999]}))
    assert cfg.train.grad_clip is None and cfg.train.betas == (0.0, 0.999)


def test_a_typo_in_the_model_section_is_refused_with_its_near_miss(tmp_path):
    with pytest.raises(UserError, match="unknown model key 'vocab_sizee' \\(did you mean 'vocab_size'\\?\\)"):
        load_config(write_config(tmp_path, model={"vocab_sizee": 300}))


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    import trainer.train as tt
    cfg = load_config(write_config(tmp_path, data={"batch_size": 100_000_000}))
    monkeypatch.setattr(tt, "initial_model", lambda cfg: pytest.fail("the model was built before the memory check"))
    with pytest.raises(UserError, match=r"data.batch_size 100000000 .* GiB for the logits"):
        train(cfg, steps=1, show_progress=False)


def test_text_data_that_is_not_utf8_is_refused(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(128, 256)) * 100)
    with pytest.raises(UserError, match="not UTF-8"):
        TokenBatches("text", str(tmp_path / "a.txt"), seq_len=16, batch_size=2, vocab_size=512, seed=0)


def test_text_and_jsonl_data(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    batches = TokenBatches("text", str(tmp_path / "a.txt"), seq_len=16, batch_size=2, vocab_size=512, seed=0)
    x, y = next(batches)
    assert x.shape == (2, 16) and y.shape == (2, 16)
    assert x[0, 0] == byte_tokenize("hello")[0] and (x[:, 1:] == y[:, :-1]).all()
    lines = [json.dumps({"text": "doc %d" % i}) for i in range(40)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    x, _ = next(TokenBatches("jsonl", str(tmp_path / "d.jsonl"), 8, 2, 512, 0))
    assert x.max() < 512


def test_malformed_jsonl_line_names_the_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(UserError, match="line 2 is not valid JSON"):
        TokenBatches("jsonl", str(tmp_path / "d.jsonl"), 8, 2, 512, 0)


def test_synthetic_data_is_deterministic():
    a = next(TokenBatches("synthetic", None, 32, 2, 512, seed=5))[0]
    b = next(TokenBatches("synthetic", None, 32, 2, 512, seed=5))[0]
    assert (a == b).all()


def test_train_logs_every_step_and_learns(tmp_path, monkeypatch):
    from aurakernel.hardware import calibration_path
    from conftest import FIXED_CALIBRATION

    monkeypatch.setenv("AURAKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    isa = {"fp32": 0.8, "bf16": 3.2}   # the ISA's theoretical peak, as calibrate states it beside the measured one
    calibration_path().write_text(json.dumps({**FIXED_CALIBRATION, "theoretical_tflops": isa}))
    cfg = load_config(TINY)
    cfg.data.seq_len, cfg.data.batch_size = 128, 2
    log = tmp_path / "log.jsonl"
    result = train(cfg, steps=6, log_path=str(log), show_progress=False)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    assert {"loss", "step_s", "tokens_per_s", "mfu", "lr", "grad_norm"} <= set(rows[0])
    run = result["runs"]["reference"]
    assert run["losses"][-1] < run["losses"][0]
    assert 0 < run["mfu"] < 1
    # MFU against the measured peak (what the machine reaches) and against the ISA's (what it could)
    assert result["peak_tflops"] == FIXED_CALIBRATION["peak_tflops"]["fp32"] and result["isa_peak_tflops"] == isa["fp32"]
    assert run["mfu_of_isa_peak"] == pytest.approx(run["mfu"] * result["peak_tflops"] / isa["fp32"])


def test_flops_count_active_parameters_and_attention():
    cfg = load_config(TINY)
    model = build_model(cfg.model, 0)
    total, active = parameter_counts(model)
    assert active < total
    c = model.config
    # per token: window keys plus compressed entries, x 2 matmuls x 2 flops x 3 (fwd+bwd)
    short = attention_flops_per_token(c, 1)
    assert short == pytest.approx(len(c.layer_types) * 3 * 2 * 2 * c.num_attention_heads * c.head_dim * 1)
