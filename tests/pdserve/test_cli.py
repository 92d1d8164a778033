"""The command line: sub-commands parse, and PDSERVE_* environment variables set defaults."""

from __future__ import annotations

from pdserve.cli import apply_env_defaults, build_parser


def test_env_sets_defaults_and_flags_win():
    env = {"PDSERVE_PORT": "12345", "PDSERVE_TRANSPORTS": "grpc",
           "PDSERVE_KV_CACHE_MEMORY_GB": "2.5", "PDSERVE_DECODE": "a:1 b:2",
           "PDSERVE_COLOCATED": "true"}
    parser = build_parser()
    apply_env_defaults(parser, "decode", env)
    args = parser.parse_args(["decode"])
    assert (args.port, args.transports, args.kv_cache_memory_gb) == (12345, "grpc", 2.5)
    assert parser.parse_args(["decode", "--port", "7"]).port == 7
    parser = build_parser()  # PDSERVE_DECODE means addresses to the gateway, a count to `up`
    apply_env_defaults(parser, "gateway", env)
    gw = parser.parse_args(["gateway"])
    assert gw.decode == ["a:1", "b:2"] and gw.colocated is True and gw.port == 12345


def test_defaults_without_env():
    args = build_parser().parse_args(["up"])
    assert (args.prefill, args.decode, args.port, args.http_port) == (1, 1, 50051, 8000)
    assert build_parser().parse_args(["prefill"]).port == 50061
    assert build_parser().parse_args(["decode"]).port == 50071


def test_decode_activations_reach_every_engine_that_decodes():
    import pytest

    from service_infra.worker_args import engine_configs

    parser = build_parser()
    for cmd in (["decode"], ["prefill"], ["gateway", "--colocated"], ["up"], ["offline", "x"],
                ["bench-engine"]):
        assert parser.parse_args(cmd).decode_activations == "auto"
        assert parser.parse_args([*cmd, "--decode-activations", "int8"]).decode_activations \
            == "int8"
    args = parser.parse_args(["decode", "--decode-activations", "float32"])
    assert engine_configs(args)["load_config"].decode_activations == "float32"
    with pytest.raises(SystemExit):  # argparse names the choices on stderr
        parser.parse_args(["decode", "--decode-activations", "int4"])


def test_quantization_reaches_every_engine():
    import pytest

    from service_infra.worker_args import engine_configs

    parser = build_parser()
    for cmd in (["decode"], ["prefill"], ["gateway", "--colocated"], ["up"], ["offline", "x"],
                ["bench-engine"]):
        assert parser.parse_args(cmd).quantization == "none"
        assert parser.parse_args([*cmd, "--quantization", "int8"]).quantization == "int8"
    args = parser.parse_args(["decode", "--quantization", "int8"])
    assert engine_configs(args)["load_config"].quantization == "int8"
    with pytest.raises(SystemExit):  # argparse names the choices on stderr
        parser.parse_args(["decode", "--quantization", "fp8"])


def test_prefill_weights_reach_every_engine_and_up_settles_auto_for_all_workers():
    """--prefill-weights reaches every engine; `pdserve up` settles "auto" once for all its
    workers, counting each worker's copy of the weights (platforms/cpu/weights.resolve_prefill_weights,
    with this machine's MemAvailable)."""
    import pytest
    import torch

    from engine_core.model_files import ModelSource, resolve_model
    from engine_core.platforms import resolve_dtype
    from engine_core.platforms.cpu.weights import available_memory_bytes, dense_copy_bytes
    from pdserve.up import prefill_weights
    from service_infra.worker_args import engine_configs

    parser = build_parser()
    for cmd in (["decode"], ["prefill"], ["gateway", "--colocated"], ["up"], ["offline", "x"],
                ["bench-engine"]):
        assert parser.parse_args(cmd).prefill_weights == "auto"
        assert parser.parse_args([*cmd, "--prefill-weights", "quantized"]).prefill_weights \
            == "quantized"
    args = parser.parse_args(["prefill", "--prefill-weights", "dense"])
    assert engine_configs(args)["load_config"].prefill_weights == "dense"
    with pytest.raises(SystemExit):
        parser.parse_args(["decode", "--prefill-weights", "int4"])
    # the default model (a Q4_1 GGUF): its 30 layers' 7 matrices, 106M weights, dense
    source = resolve_model(None)
    dtype = resolve_dtype(None, torch.device("cpu"))
    dense = dense_copy_bytes(source, dtype)
    assert dense == 30 * (576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536) * dtype.itemsize
    if torch.cuda.is_available():
        return  # up leaves auto to the workers there (no blocks to read on CUDA)
    assert prefill_weights(parser.parse_args(["up"]), source) == "dense"
    assert prefill_weights(parser.parse_args(["up", "--prefill-weights", "quantized"]),
                           source) == "quantized"
    with pytest.raises(ValueError, match="a safetensors model without them"):
        prefill_weights(parser.parse_args(["up", "--prefill-weights", "quantized"]),
                        ModelSource("hf", source.path.parent))
    # as many workers as it takes for their dense copies to pass 80 % of the memory available
    many = int(available_memory_bytes() / (dense + source.path.stat().st_size)) + 1
    assert prefill_weights(parser.parse_args(["up", "--prefill", str(many)]), source) \
        == "quantized"


def test_cache_decoded_blocks_is_on_for_every_serving_engine_and_can_be_turned_off():
    """On for the served engines (`pdserve up` hands it to its decode workers: the routing
    test in tests/e2e sees a follow-up hit its reply's blocks), off for the offline LLM."""
    from engine_core.engine_config import CacheConfig
    from service_infra.worker_args import engine_configs

    parser = build_parser()
    for cmd in (["decode"], ["gateway", "--colocated"], ["up"]):
        assert parser.parse_args(cmd).cache_decoded_blocks is True
        assert parser.parse_args([*cmd, "--no-cache-decoded-blocks"]).cache_decoded_blocks \
            is False
    assert engine_configs(parser.parse_args(["decode"]))["cache_config"].cache_decoded_blocks \
        is True
    args = parser.parse_args(["decode", "--no-cache-decoded-blocks"])
    assert engine_configs(args)["cache_config"].cache_decoded_blocks is False
    assert CacheConfig().cache_decoded_blocks is False


def test_enforce_eager_reaches_every_engine_that_decodes():
    import pytest

    from service_infra.worker_args import engine_configs

    parser = build_parser()
    for cmd in (["decode"], ["gateway", "--colocated"], ["up"], ["offline", "x"],
                ["bench-engine"]):
        assert parser.parse_args(cmd).enforce_eager is False
        assert parser.parse_args([*cmd, "--enforce-eager"]).enforce_eager is True
    assert engine_configs(parser.parse_args(["decode"]))["device_config"].enforce_eager is False
    args = parser.parse_args(["decode", "--enforce-eager"])
    assert engine_configs(args)["device_config"].enforce_eager
    # a prefill worker runs no decode steps: it has no such flag and never captures graphs
    assert engine_configs(parser.parse_args(["prefill"]))["device_config"].enforce_eager is False
    with pytest.raises(SystemExit):
        parser.parse_args(["prefill", "--enforce-eager"])


def test_the_canary_is_on_by_default_for_every_disaggregated_gateway():
    """The canary's idle time defaults to 10 s on `pdserve up` (passed on to its gateway) and on
    a disaggregated gateway; 0 turns it off. The e2e stacks turn it off (tests/e2e/stack.py)."""
    from gateway.disagg.canary import CanaryConfig

    parser = build_parser()
    for cmd in (["up"], ["gateway", "--prefill", "p:1", "--decode", "d:1"]):
        args = parser.parse_args(cmd)
        config = CanaryConfig(args.canary_idle_s, args.canary_timeout_s, args.canary_failures)
        assert (config.idle_s, config.is_on) == (10.0, True)
        off = parser.parse_args([*cmd, "--canary-idle-s", "0"])
        assert not CanaryConfig(off.canary_idle_s).is_on
