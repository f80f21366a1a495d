"""Model and decoding configuration: the one source the model, the exporter and the Triton
configs are built from. Saved inside every checkpoint."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    num_items: int  # item indices are 1..num_items; 0 is padding
    num_actions: int = 8  # action ids 0..num_actions-1 (0 = none/unknown, 7 = ranking target)
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    max_seq_len: int = 200  # N: longest history kept, and HSTU's fixed attention divisor
    num_time_buckets: int = 64
    time_bucket_base: float = 1.6  # buckets of log_base(1 + |dt seconds|)
    dropout: float = 0.2
    # semantic IDs: 3 residual k-means levels + 1 collision code (size filled in when built)
    codebook_sizes: tuple = (256, 256, 256, 1)
    decoder_heads: int = 2
    # per decoding step t, the number of level-(t+1) prefixes of the codebook when step t adds a
    # learned vector per prefix to its code logits (SemanticIdDecoder.add_node_scores), 0 where not;
    # () = no step does (filled in from the codebook when built)
    node_output_sizes: tuple = ()
    shared_kv_projection: bool = False  # PFA ablation: one K/V projection for all steps
    ranker_negatives: int = 64
    ranker_hard_fraction: float = 0.5  # share of the ranker negatives that share the positive's first code
    dense_temperature: float = 0.0  # > 0: the dense head scores cosine similarity / temperature
    # training only: an item's vector adds the embeddings of the first this-many codes of its
    # semantic ID (HSTUEncoder.item_vectors); a written checkpoint holds them folded into the item
    # table and says 0
    code_embedding_levels: int = 0
    # a written checkpoint keeps the code embeddings beside the folded table, and here the levels
    # they cover: the catalog builds an added item's vector from its codes' embeddings
    catalog_code_levels: int = 0
    # what the semantic IDs were quantized from (semantic_ids.ITEM_EMBEDDING_SOURCES, "" = not
    # recorded): the space an added item's content must be embedded into
    semantic_id_source: str = ""
    # the co-visitation expert (model/covisitation.py): pairs of training events within this many
    # events of each other are counted; 0 = no such expert
    covisit_window: int = 0
    # served ("fused") order: retrieval log-probability + w * M-FALCON logit + v * the dense head's
    # log-softmax over all items + u * the co-visitation score (a product of four experts; the dense
    # head's score beside the generative one, as "Unifying Generative and Dense Retrieval for
    # Sequential Recommendation" ranks its candidates). w, v and u are chosen on the validation split
    # after training (export.train, export.evaluate --tune-fusion), once with already-seen items
    # kept in the list and once with them excluded (None: the same as kept)
    rank_fusion_weight: float = 1.0
    rank_fusion_weight_seen_excluded: float | None = None
    dense_fusion_weight: float = 0.0
    dense_fusion_weight_seen_excluded: float | None = None
    covisit_fusion_weight: float = 0.0
    covisit_fusion_weight_seen_excluded: float | None = None
    # items added to the catalog after training (model/catalog.py) have no co-visitation counts and a
    # vector from their codes alone: the served order adds the `catalog_candidates` live added items
    # nearest in content to the user's last items to the beam's candidates (with the beam's lowest
    # log-probability, an upper bound of theirs) and adds catalog_content_weight * the content cosine
    # to an added item's score (chosen once on Amazon Scientific's validation split, cold-start protocol:
    # docs/catalog.md); trained items score as before. Not a checkpoint's: these defaults apply to every one
    catalog_candidates: int = 10
    catalog_content_weight: float = 5.0

    def fusion_weights(self, exclude_seen: bool = False) -> tuple[float, float, float]:
        """The fused order's (ranker weight w, dense weight v, co-visitation weight u) under a
        seen-item policy."""
        def pick(kept, excluded):
            return excluded if exclude_seen and excluded is not None else kept
        return (pick(self.rank_fusion_weight, self.rank_fusion_weight_seen_excluded),
                pick(self.dense_fusion_weight, self.dense_fusion_weight_seen_excluded),
                pick(self.covisit_fusion_weight, self.covisit_fusion_weight_seen_excluded))

    def set_fusion_weights(self, included: tuple, excluded: tuple) -> None:
        """(w, v, u) with seen items included and with them excluded."""
        self.rank_fusion_weight, self.dense_fusion_weight, self.covisit_fusion_weight = map(float, included)
        (self.rank_fusion_weight_seen_excluded, self.dense_fusion_weight_seen_excluded,
         self.covisit_fusion_weight_seen_excluded) = map(float, excluded)

    @property
    def num_codes(self) -> int:
        return len(self.codebook_sizes)

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in _NOT_SAVED}
        d["codebook_sizes"] = list(self.codebook_sizes)
        d["node_output_sizes"] = list(self.node_output_sizes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = {k: v for k, v in d.items() if k not in _NOT_SAVED}
        d["codebook_sizes"] = tuple(d["codebook_sizes"])
        d["node_output_sizes"] = tuple(d.get("node_output_sizes", ()))
        return cls(**d)


_NOT_SAVED = ("catalog_candidates", "catalog_content_weight")  # the code's defaults serve every checkpoint

ATTENTION_MODES = ("full", "pfa", "pfa_per_beam", "dynamic_topk")

# M-FALCON candidates scored per call. Scores do not depend on it (a candidate attends to the
# history and to itself only) and its cost is linear in it, so fewer, larger calls win: on the
# CPU 256 is faster than 64 at every candidate count measured (perf/results/ranking_throughput.json),
# and a beam of up to 256 is ranked in one call (the TensorRT profile's largest microbatch).
RANKER_MICROBATCH = 256


@dataclass(frozen=True)
class DecodeOptions:
    """How the beam search attends over history (the PFA paper's ablation axes), switchable per call.
    Frozen: equal options are one key (the served decoder's batches, its CUDA graphs)."""

    mode: str = "pfa"  # one of ATTENTION_MODES
    beam_width: int = 100
    k: int = 256  # rows kept at the selection step
    r: float = 0.5  # budget ratio: k_t = max(1, ceil(k * r ** (t - selection_step)))
    selection_step: int = 1  # 0..num_codes-1
    collect_attention: bool = False  # record per-step attention for the PFA paper's attention statistics

    def __post_init__(self):
        if self.mode not in ATTENTION_MODES:
            raise ValueError(f"mode must be one of {ATTENTION_MODES}, got {self.mode!r}")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if not 0.0 < self.r <= 1.0:
            raise ValueError(f"r must be in (0, 1], got {self.r}")
        if self.selection_step < 0:
            raise ValueError(f"selection_step must be >= 0, got {self.selection_step}")

    def budget(self, step: int) -> int:
        """Rows read at `step` after selection: k_t = max(1, ceil(k r^(t - s)))."""
        import math

        return max(1, math.ceil(self.k * self.r ** (step - self.selection_step)))


@dataclass
class TrainConfig:
    epochs: int = 20
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.0
    stochastic_length_alpha: float = 2.0  # 2.0 = off; the HSTU paper uses about 1.6 for long histories
    ranker_weight: float = 1.0
    ranker_positions: int = 1  # history positions per user a training batch ranks candidates at
    # the auxiliary dense loss (last state . item embeddings): its weight (0 = off) and the shared
    # uniform negatives of its sampled softmax (0 = a softmax over the whole catalog)
    dense_weight: float = 1.0
    dense_negatives: int = 0
    # negatives drawn from the user's own events up to the scored position, per position: this
    # many of the ranker's negatives, and as many more for the dense head's softmax. Where a data
    # set has no repeat consumption, they teach both heads what its targets say (an item already
    # seen is not next); where it has, an event equal to the target is masked, not a negative
    seen_negatives: int = 0
    # this share of the history's events shows the unknown item (HSTUEncoder's row I + 1) instead of
    # its own, as out-of-vocabulary handling does, so an event on an item a served version does not
    # know is encoded with a learned vector (its targets stay the real items)
    unknown_item_share: float = 0.0
    # "constant", or "cosine": lr decays to lr * lr_min_ratio over the run (its time budget when
    # one is given, else its epochs)
    lr_schedule: str = "constant"
    lr_min_ratio: float = 0.05
    # the weights validated and saved: an exponential moving average of the trained ones with
    # this decay per step (0 = the trained weights themselves)
    ema_decay: float = 0.0
    # events held out at the end of each user's sequence: 2 = the validation and test targets
    # (model selection on validation); 1 = the test target only, a final refit whose epochs and
    # fusion weight come from a validation run (the HSTU public code trains this way)
    end_offset: int = 2
    # the codes each level's cross-entropy normalizes over: "all" C_t codes, or "valid": only
    # those continuing the target's prefix to some item, the set beam search normalizes over
    code_loss: str = "all"
    # validation after every epoch once this share of the run is done (by epochs or by time,
    # whichever is further); before it, after every `validate_every`-th epoch only: with a cosine
    # schedule the best epoch comes late, and early checks only draw the curve
    validate_from: float = 0.5
    validate_every: int = 5
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        # runs from before the named fields passed the dense loss's settings in `extra`
        extra = dict(self.extra)
        self.dense_weight = float(extra.pop("dense_weight", self.dense_weight))
        self.dense_negatives = int(extra.pop("dense_negatives", self.dense_negatives))
        self.extra = extra

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """A saved configuration (a training state's "train_config", a result file's "train"),
        also one from before the dense_* fields, which had them in "extra"."""
        return cls(**d)
