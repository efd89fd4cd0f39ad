"""Static model configurations.

Every model in eagle-jax is described by one frozen (hashable) dataclass, so a
config can be passed to `jax.jit` as a static argument. Parsers from the
`config.json` dialects people ship live in `eagle_jax.convert`; this module
only defines the shapes and validates them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration value is missing, unknown or contradicts another one."""


class CheckpointError(ConfigError):
    """A checkpoint (target or drafter) cannot be read, or its tensors are missing, unexpected
    or inconsistent with its config."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base `theta` plus an optional scaling rule.

    `scaling_type` is one of None, "linear", "llama3", "yarn". The remaining
    fields are only read by the rule that uses them (HF names in comments).
    """

    theta: float = 10000.0
    scaling_type: str | None = None
    factor: float = 1.0  # rope_scaling.factor
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn (mscale); None = 0.1 ln(f) + 1

    def __post_init__(self):
        if self.scaling_type not in (None, "linear", "llama3", "yarn"):
            raise ConfigError(
                f"unsupported rope_scaling type {self.scaling_type!r}; "
                "supported: linear, llama3, yarn (dynamic NTK scaling depends on the "
                "running sequence length and cannot be expressed with static shapes)"
            )
        if self.theta <= 0:
            raise ConfigError(f"rope_theta must be positive, got {self.theta}")


def _positive(owner: str, **values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Sparse mixture-of-experts MLP layers (Qwen3-MoE; DeepSeek-V3 and Kimi K2).

    A token's router logits x @ router [E] score the experts: `scoring` "softmax"
    (Qwen3-MoE) or "sigmoid" (DeepSeek-V3), where the choice adds the per-expert
    `e_score_correction_bias` to the scores and keeps only the experts of the
    `topk_groups` best of `num_groups` equal groups (a group's score: the sum of its
    two best). The top `experts_per_token` experts' scores (without the bias) are the
    weights: divided by their sum when `norm_topk_prob`, times `routed_scaling_factor`.
    The output is the weighted sum of those experts' SwiGLU MLPs (width
    `intermediate_size`) plus, with `num_shared_experts` > 0, one dense SwiGLU MLP of
    width num_shared_experts * intermediate_size that every token goes through.
    `layers`: the decoder layers whose MLP is this block; the others keep the dense
    MLP of `TargetConfig.intermediate_size`.
    """

    num_experts: int  # n_routed_experts / num_experts
    experts_per_token: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size
    layers: tuple[int, ...]
    scoring: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    num_groups: int = 1  # n_group
    topk_groups: int = 1  # topk_group
    num_shared_experts: int = 0  # n_shared_experts

    def __post_init__(self):
        _positive("MoEConfig", num_experts=self.num_experts, experts_per_token=self.experts_per_token,
                  intermediate_size=self.intermediate_size, num_groups=self.num_groups,
                  topk_groups=self.topk_groups)
        if self.scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"MoE scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ConfigError(f"num_shared_experts must be a non-negative integer, got {self.num_shared_experts!r}")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ConfigError(f"n_group ({self.num_groups}) must divide the experts ({self.num_experts}) and be at "
                              f"least topk_group ({self.topk_groups})")
        per_group = self.num_experts // self.num_groups
        if self.scoring == "softmax" and self.num_groups != 1:
            raise ConfigError(f"grouped expert choice (n_group {self.num_groups}) is defined for sigmoid scoring only")
        if self.scoring == "sigmoid" and per_group < 2:
            raise ConfigError(f"sigmoid scoring ranks groups by their two best experts: a group of {per_group} "
                              f"({self.num_experts} experts in {self.num_groups} groups)")
        if self.experts_per_token > self.topk_groups * per_group:
            raise ConfigError(f"num_experts_per_tok ({self.experts_per_token}) exceeds the experts of the "
                              f"{self.topk_groups} chosen group(s) ({self.topk_groups * per_group})")
        if not self.routed_scaling_factor > 0:
            raise ConfigError(f"routed_scaling_factor must be positive, got {self.routed_scaling_factor!r}")
        if list(self.layers) != sorted(set(self.layers)):
            raise ConfigError(f"MoE layers must be distinct and ascending, got {self.layers!r}")

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.intermediate_size


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2).

    Each token's keys and values come from one latent c = norm(x @ W_DKV)
    [kv_lora_rank] shared by the heads (W_UK, W_UV expand it per head:
    `qk_nope_head_dim` key and `v_head_dim` value columns) plus one rotary key
    [qk_rope_head_dim] shared by the heads; the cache holds c and the rotary key.
    Queries come from x (`q_lora_rank` None) or through a normed low-rank
    projection of that rank. The softmax scale is (qk_nope + qk_rope)^-1/2, times
    mscale(factor, `mscale_all_dim`)^2 under YaRN when mscale_all_dim is set.
    `rope_interleave`: the rope columns of the q and kv_a projections hold
    interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout, transformers'
    default), else the rotate-half layout. `norm_eps`: the epsilon of the q_a and
    kv_a RMSNorms (transformers builds them with 1e-6 whatever rms_norm_eps; vLLM,
    SGLang and TorchSpec build an EAGLE drafter's with its rms_norm_eps).
    """

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mscale_all_dim: float = 0.0
    rope_interleave: bool = True
    norm_eps: float = 1e-6

    def __post_init__(self):
        _positive("MLAConfig", kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                  qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
        if self.q_lora_rank is not None:
            _positive("MLAConfig", q_lora_rank=self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not self.norm_eps > 0:
            raise ConfigError(f"MLAConfig.norm_eps must be a positive number, got {self.norm_eps!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class _AttentionShape:
    """Shared by the target and drafter configs: GQA head arithmetic, and the column
    layout of the fused projections. `fused_groups` g: the q|k|v and gate|up columns
    come in g groups, group i holding the i-th g-th of the q heads, of the KV heads and
    of v (of gate and of up), so a model axis of g shards holds whole pieces
    (`sharding.fused_layout`); 1 is the checkpoint layout, [q | k | v], [gate | up]."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    fused_groups: int
    qkv_bias: bool
    o_bias: bool
    mla: MLAConfig | None

    def _check_heads(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        g = self.fused_groups
        if not isinstance(g, int) or g < 1 or self.num_kv_heads % g or self.intermediate_size % g:
            raise ConfigError(f"fused_groups ({g!r}) must be a positive integer dividing num_key_value_heads "
                              f"({self.num_kv_heads}) and intermediate_size ({self.intermediate_size})")

    def _check_mla(self, owner: str) -> None:
        """With multi-head latent attention (`mla`): head_dim is the rotary head dim and
        num_kv_heads = num_heads (as transformers sets them); no q/k/v or o biases; a drafter has
        one column group (a target's groups regroup its MLP and shared experts on a mesh)."""
        m = self.mla
        if m is None:
            return
        if self.head_dim != m.qk_rope_head_dim or self.num_kv_heads != self.num_heads:
            raise ConfigError(f"an MLA {owner} has head_dim = qk_rope_head_dim ({m.qk_rope_head_dim}) and "
                              f"num_kv_heads = num_heads ({self.num_heads}), got {self.head_dim}, {self.num_kv_heads}")
        if self.qkv_bias or self.o_bias or (owner != "target" and self.fused_groups != 1):
            raise ConfigError(f"an MLA {owner} has no q/k/v or o biases" + ("" if owner == "target" else
                              " and fused_groups 1"))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class TargetConfig(_AttentionShape):
    """A Llama-family decoder (Llama 2/3.x, SmolLM2, Qwen2, Qwen3), optionally with
    sparse MoE MLP layers (`moe`: Qwen3-MoE, DeepSeek-V3) and multi-head latent
    attention (`mla`: DeepSeek-V3, Kimi K2; then `head_dim` is the rotary head dim
    qk_rope_head_dim and `num_kv_heads` = `num_heads`, as transformers sets them).

    Parameter shapes (see `eagle_jax.models.target`):
      embed [V, H]; layers.* stacked on a leading [L] axis (one dict per layer
      with `moe` or `mla`); lm_head [H, V] unless `tie_word_embeddings`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama `attention_bias`
    o_bias: bool = False  # Llama `attention_bias` also biases o_proj
    qk_norm: bool = False  # Qwen3 per-head RMSNorm on q and k
    architecture: str = "LlamaForCausalLM"
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name_or_path: str = ""
    fused_groups: int = 1  # see _AttentionShape
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self._check_heads()
        if self.moe is not None and not all(0 <= i < self.num_layers for i in self.moe.layers):
            raise ConfigError(f"MoE layers {self.moe.layers} outside [0, {self.num_layers})")
        self._check_mla("target")
        if self.mla is not None and self.qk_norm:
            raise ConfigError("an MLA target has no q/k norms")

    @property
    def per_layer(self) -> bool:
        """Whether the layers differ in parameters (MoE or MLA): one dict per layer, unrolled."""
        return self.moe is not None or self.mla is not None

    def default_aux_layers(self) -> tuple[int, int, int]:
        """EAGLE-3 default: residual streams entering layers (2, N//2, N-3)."""
        n = self.num_layers
        return (2, n // 2, n - 3)


@dataclass(frozen=True)
class DrafterConfig(_AttentionShape):
    """An EAGLE-3 / EAGLE 3.1 drafter: FC over target features + one decoder layer.

    `aux_layer_ids` use the vLLM/SafeAILab convention: id i is the residual
    stream *entering* target layer i (HF `hidden_states[i]`). An empty tuple
    means "the EAGLE-3 default of the target it runs with" (a config that names
    no ids, loaded without a target): `num_aux_states` of them, resolved by
    `for_target`.

    `sliding_window` (None = full attention): a query at position p sees the
    keys at positions (p - sliding_window, p], the rule of HF, vLLM and
    speculators for a `layer_types: ["sliding_attention"]` layer.

    Flags (EAGLE.md section 2-4):
      fc_norm               one RMSNorm per aux slot before the FC (EAGLE 3.1)
      norm_before_fc        one RMSNorm over the concatenated features
      norm_before_residual  residual of the layer is hidden_norm(h) instead of h
      norm_output           feed back norm(h) instead of h (EAGLE 3.1)

    `mask_token_id` (None: a sequential drafter) makes it a parallel drafter (P-EAGLE,
    vLLM's `parallel_drafting`): one forward proposes a k-token chain, positions 2..k
    fed the placeholder, i.e. the embedding row of this token id and the learned
    `mask_hidden` [A*Ht] projected like target features (`models.drafter.draft_parallel`).

    `mla` (None: grouped-query attention) makes the layer attend with multi-head latent
    attention over a compressed cache (`models.mla`; vLLM's `Eagle3DeepseekV2ForCausalLM`,
    the Kimi K2.x drafters): its q_a and kv_a projections read the same 2H input the
    q/k/v projections would; then `head_dim` is qk_rope_head_dim and `num_kv_heads` =
    `num_heads`, as for an MLA target.
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target vocabulary (embedding rows)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 8192
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    has_embedding: bool = False  # the checkpoint carries its own embed_tokens
    verifier_name_or_path: str = ""
    verifier_architecture: str = "LlamaForCausalLM"
    speculative_tokens: int = 3
    sliding_window: int | None = None
    num_aux_states: int = 3  # only read while aux_layer_ids is ()
    fused_groups: int = 1  # see _AttentionShape
    mask_token_id: int | None = None  # the P-EAGLE placeholder token; None: not a parallel drafter
    mla: MLAConfig | None = None  # multi-head latent attention; None: grouped-query attention

    def __post_init__(self):
        m = self.mask_token_id
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < self.vocab_size):
            raise ConfigError(f"mask_token_id must be a token id in [0, {self.vocab_size}), got {m!r}")
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError(
                "fc_norm and norm_before_fc are mutually exclusive: fc_norm normalises "
                "each aux hidden state, norm_before_fc the concatenation"
            )
        if self.num_aux < 1:
            raise ConfigError("a drafter needs at least one aux hidden state")
        if self.sliding_window is not None and (
                isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                or self.sliding_window < 1):
            raise ConfigError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size ({self.draft_vocab_size}) exceeds the target "
                f"vocab_size ({self.vocab_size})"
            )
        self._check_heads()
        self._check_mla("drafter")

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids) if self.aux_layer_ids else self.num_aux_states

    def for_target(self, target: "TargetConfig") -> "DrafterConfig":
        """This config with `()` aux ids resolved to the target's EAGLE-3 default."""
        if self.aux_layer_ids:
            return self
        ids = target.default_aux_layers()
        if len(ids) != self.num_aux_states:
            raise ConfigError(f"the drafter reads {self.num_aux_states} aux states and names no "
                              f"layer ids; the target's default has {len(ids)}")
        return self.replace(aux_layer_ids=tuple(ids))

    @property
    def fc_in_size(self) -> int:
        return self.num_aux * self.target_hidden_size

    @property
    def parallel_drafting(self) -> bool:
        """A P-EAGLE drafter: it has a placeholder (`mask_token_id`, `mask_hidden`)."""
        return self.mask_token_id is not None

    @property
    def is_eagle31(self) -> bool:
        return self.fc_norm and self.norm_output

    def replace(self, **changes) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SamplingConfig:
    """One request's sampling rule for target (and draft) logits, validated;
    the loop carries it as a row of `spec_decode.sampling.SamplingParams`.

    temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpecConfig:
    """Drafting envelope (static shapes).

    method "chain": `num_speculative_tokens` drafted tokens in a line.
    method "tree": EAGLE-2 dynamic tree; each of `tree_depth` levels expands
    the `tree_top_k` best frontier nodes by `tree_top_k` children, and the
    `tree_total_tokens - 1` best nodes (plus the root) are verified.
    """

    # Defaults measured on the embedded default with the shipped EAGLE 3.1 drafter on
    # the 2-core CPU (README "Speculative defaults", envelope-sweep and drafter-ab runs):
    # a chain of 3. Of the trees, 3x2x6 beat 4x2x8 in both runs that had both
    # (speed-tree-envelopes-20261203-072437, speed-drafter-ab-20261203-195026: 1.34x /
    # 1.26x against 1.17x / 1.13x plain on HumanEval / ShareGPT): it keeps most of the
    # acceptance (tau 1.89 against 1.91) and verifies 6 tokens, not 8, which two cores
    # compute at about 1 ms a row over the cost of reading the weights once.
    method: str = "chain"
    num_speculative_tokens: int = 3
    tree_top_k: int = 3
    tree_depth: int = 2
    tree_total_tokens: int = 6
    # Batches of more rows than this decode plainly (vLLM's disable_by_batch_size;
    # the output is the same either way). None: always speculate; "auto": the
    # backend's measured default (`runtime.default_disable_by_batch_size`).
    disable_by_batch_size: int | str | None = "auto"

    def __post_init__(self):
        d = self.disable_by_batch_size
        if not (d is None or d == "auto" or (isinstance(d, int) and not isinstance(d, bool) and d >= 1)):
            raise ConfigError(f"disable_by_batch_size must be a batch size >= 1, None or 'auto', got {d!r}")
        if self.method not in ("chain", "tree"):
            raise ConfigError(f"method must be 'chain' or 'tree', got {self.method!r}")
        if self.method == "chain" and self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.method == "tree":
            k, d, n = self.tree_top_k, self.tree_depth, self.tree_total_tokens
            if k < 1 or d < 1:
                raise ConfigError(f"tree_top_k and tree_depth must be >= 1, got {k}, {d}")
            most = k + (d - 1) * k * k
            if not 2 <= n <= most + 1:
                raise ConfigError(f"tree_total_tokens must be in [2, {most + 1}] for top_k={k}, "
                                  f"depth={d}, got {n}")

    @property
    def top_k(self) -> int:
        return 1 if self.method == "chain" else self.tree_top_k

    @property
    def depth(self) -> int:
        return self.num_speculative_tokens if self.method == "chain" else self.tree_depth

    @property
    def total_tokens(self) -> int:
        """Tokens per verify pass, the root (last committed token) included."""
        return self.num_speculative_tokens + 1 if self.method == "chain" else self.tree_total_tokens

    def at_depth(self, depth: int) -> "SpecConfig":
        """The same drafting at `depth` levels (1 <= depth <= self.depth): a chain of
        `depth` tokens, or a tree `depth` levels deep verifying at most as many
        tokens as this one (the engine lowers the depth by measured cost)."""
        if not 1 <= depth <= self.depth:
            raise ConfigError(f"a draft depth must be in [1, {self.depth}], got {depth}")
        if self.method == "chain":
            return dataclasses.replace(self, num_speculative_tokens=depth)
        k = self.tree_top_k
        return dataclasses.replace(self, tree_depth=depth,
                                   tree_total_tokens=min(self.tree_total_tokens, k + (depth - 1) * k * k + 1))
