"""What the engine fills in: the batch triple from any two of its members, and every "auto"
value from what it knows (the world size, the model's dtype and hidden size), including
zeroengine's own sizing rules for stage 3's windows and fetch units."""
from __future__ import annotations

from ..errors import ConfigError
from .fields import AUTO
from .policy import notice
from .rules import check_config
from .schema import Config
from .zero import ZeroConfig


def resolve_batch(cfg: Config, world_size: int) -> None:
    """Fill in the batch triple from any two (or one) of its members; refuse inconsistency.

    train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size
    """
    tbs, mbs, gas = (None if v == AUTO else v for v in (
        cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps))
    triple = (f"train_batch_size={tbs}, train_micro_batch_size_per_gpu={mbs}, "
              f"gradient_accumulation_steps={gas}, world size {world_size}")
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * world_size:
            raise ConfigError(f"inconsistent batch sizes: {triple}; train_batch_size must equal "
                              f"micro batch x accumulation steps x world size = "
                              f"{mbs * gas * world_size}")
    elif tbs is not None and mbs is not None:
        gas, rem = divmod(tbs, mbs * world_size)
        if rem or gas < 1:
            raise ConfigError(f"train_batch_size {tbs} is not a multiple of "
                              f"train_micro_batch_size_per_gpu x world size = {mbs * world_size}")
    elif tbs is not None:
        gas = gas or 1
        mbs, rem = divmod(tbs, gas * world_size)
        if rem or mbs < 1:
            raise ConfigError(f"train_batch_size {tbs} is not a multiple of "
                              f"gradient_accumulation_steps x world size = {gas * world_size}")
    else:
        gas = gas or 1
        tbs = mbs * gas * world_size if mbs is not None else None
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu = tbs, mbs
    cfg.gradient_accumulation_steps = gas


def auto_stage3_window(partitioned_numel: float, largest_segment_numel: float) -> int:
    """What "auto" means for stage3_prefetch_bucket_size and stage3_max_reuse_distance, in
    elements: an eighth of the partitioned model and at least two of its largest segments (the
    next module is then always on its way) - a few layers of a transformer, so the gathered part
    stays a fraction of the model at any size. The engine resolves it from the model it lays
    out (ParamFetcher), the scale model from the job it predicts."""
    return int(max(2 * largest_segment_numel, partitioned_numel // 8))


# Past this many elements a unit gains little from more grouping: a gloo all-gather's fixed
# cost (~0.3 ms) is then under 15% of its transfer (~2.3 ns an element), and larger transient
# segments cost resident memory (benchmarks/growth_bench.py, README "Many modules").
AUTO_FETCH_UNIT_MAX = 1_000_000


def auto_fetch_unit(partitioned_numel: int, bucket_numel: int) -> int:
    """What "auto" means for stage3_fetch_unit_size, in elements: a sixteenth of the
    partitioned model, at most AUTO_FETCH_UNIT_MAX and a gradient bucket (reduce_bucket_size;
    a segment never spans more). A deep model of small modules then makes one collective per
    ~1M elements rather than one per module; a model of large modules (a transformer's
    matrices past ~1M elements each) keeps a unit per module, as before grouping."""
    return int(min(bucket_numel, AUTO_FETCH_UNIT_MAX, partitioned_numel // 16))


def model_hidden_size(module) -> int | None:
    """The hidden size a Hugging Face model's config declares (hidden_size, the largest of
    hidden_sizes, or the same under text_config), as transformers' DeepSpeed integration reads
    it to fill in "auto" bucket sizes; None for a model without such a config."""
    config = getattr(module, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        size = getattr(source, "hidden_size", None)
        if isinstance(size, int) and size > 0:
            return size
        sizes = getattr(source, "hidden_sizes", None)
        if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(v, int) for v in sizes):
            return max(sizes)
    return None


def _resolve_bucket_autos(cfg: Config, hidden_size: int | None) -> None:
    """The bucket sizes a config sets to "auto": from the model's hidden size h as transformers
    fills them for DeepSpeed (reduce h*h; stage 3: prefetch 0.9*h*h, persistence 10*h), else
    zeroengine's own values. Each chosen value is said once."""
    zero = cfg.zero_optimization
    written = getattr(cfg, "written_auto", frozenset())
    stage3 = zero.stage == 3
    rules = {"reduce_bucket_size": (lambda h: h * h, "hidden_size^2"),
             "stage3_param_persistence_threshold": (lambda h: 10 * h, "10 x hidden_size"),
             "stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), "0.9 x hidden_size^2")}
    defaults = ZeroConfig()
    for name, (rule, text) in rules.items():
        path = f"zero_optimization.{name}"
        if getattr(zero, name) != AUTO or (name == "stage3_prefetch_bucket_size"
                                           and path not in written):
            continue  # the prefetch default is "auto" too: the engine's window
        if not stage3 and name != "reduce_bucket_size":
            setattr(zero, name, getattr(defaults, name))  # a stage-3 key: unused below stage 3
            continue
        if hidden_size is not None:
            value = rule(hidden_size)
            why = f"{text} with the model's config.hidden_size {hidden_size}, as the Hugging " \
                  "Face DeepSpeed integration fills it"
        elif name == "stage3_prefetch_bucket_size":
            notice(path, "'auto': sized by the engine from the model it partitions (a window of "
                   "a few layers; the model has no config.hidden_size to size it from)")
            continue
        else:
            value = getattr(defaults, name)
            why = "zeroengine's default" + ("" if hidden_size is not None else
                                            " (the model has no config.hidden_size)")
        setattr(zero, name, value)
        notice(path, f"'auto' resolved to {value:,} ({why})")


def resolve_auto(cfg: Config, world_size: int, param_dtype_name: str | None = None,
                 hidden_size: int | None = None) -> Config:
    """Replace 'auto' values with what the engine knows; refuse the ones it cannot know.
    ``hidden_size``: the model's (model_hidden_size), which sizes "auto" buckets."""
    resolve_batch(cfg, world_size)
    if cfg.gradient_clipping == AUTO:
        cfg.gradient_clipping = 1.0
        notice("gradient_clipping", "'auto' resolved to 1.0, the Hugging Face Trainer's default "
               "max_grad_norm")
    if cfg.fp16.enabled == AUTO:
        cfg.fp16.enabled = param_dtype_name == "float16"
    if cfg.bf16.enabled == AUTO:
        cfg.bf16.enabled = param_dtype_name == "bfloat16"
    _resolve_bucket_autos(cfg, hidden_size)
    # what stays "auto" (stage3_prefetch_bucket_size and stage3_max_reuse_distance by default)
    # the engine sizes from the model it partitions
    return check_config(cfg)  # the rules that waited for an "auto" to be resolved
