"""A living catalog: items added to and retired from a served version while it serves, with no
retraining and no version swap.

Semantic IDs exist for this (*Actions Speak Louder than Words*, section 1: a platform's vocabulary
is dynamic; *Unifying Generative and Dense Retrieval for Sequential Recommendation* adds cold items
to the candidates): an item no model has seen gets an ID from its content, and the decoder can then
generate it. An added item is placed with the parts of the version that already exist:

- its semantic ID: the version's own residual k-means quantizer (the nearest center per level for its
  content embedding, in the space the IDs were fit in), then the smallest collision code no item of
  that prefix holds; where the prefix has none free, the last level's next-nearest center. An ID is
  never given twice, also after its item is retired;
- its item vector: the sum of its codes' embeddings (HSTUEncoder.code_vectors), the part of a trained
  item's vector its codes give; the unknown item's vector where the version kept no code embeddings;
- its row: the next free row of the item table past the unknown item's (capacity reserved at load).

It then enters every place an item lives: the decoder's valid-prefix tables (trained prefixes keep
their ids and node vectors; a new prefix gets a new id and a zero node vector), the item table the
encoder, the ranker and the dense head read, and the vocabulary. It has no co-visitation counts.
A retired item leaves the valid-prefix tables and the dense head's softmax (item_live), so it is
never generated or returned again; its row, vector and ID stay, so a history holding it encodes as
before.

Changes are applied in their order (the catalog store numbers them) by the same rules in every
stage of every replica, whichever parts of the model it holds, so each places an item at the same
row with the same ID. Applying changes replaces tables, never edits one a request is reading: the
caller applies between requests.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

DEFAULT_CAPACITY = 100_000  # rows reserved at load for added items
ALTERNATIVES = 32  # the last level's nearest centers tried for a free collision code
TEXT_ENCODER_SOURCE = "text-encoder"


class ItemCatalog:
    """The catalog state of one loaded model (a whole model or a stage's parts): `apply` replays
    the store's changes in order onto it. `version` is the last change applied."""

    def __init__(self, model, capacity: int = DEFAULT_CAPACITY):
        if model.codebook is None:
            raise ValueError("the catalog needs the model's codebook (its semantic IDs and quantizer)")
        self.model = model
        cfg = model.cfg
        self.capacity = int(capacity)
        self.first_row = cfg.num_items + 2  # rows 0..I + 1: padding, the trained items, the unknown item
        rows = self.first_row + self.capacity
        self.version = 0
        codebook = model.codebook
        L = codebook.num_levels
        # the trained state every apply rebuilds from
        self._trained_children = [codebook.child(t).cpu() for t in range(L)]
        self._trained_prefixes = codebook.level_prefixes(codebook.codes).cpu()  # [I + 1, L + 1]
        self._trained_nodes = {t: e.weight.detach().clone() for t, e in model.decoder.node_emb.items()} \
            if model.decoder is not None else {}
        self.codes = torch.full((rows, L), -1, dtype=torch.long)
        self.codes[: cfg.num_items + 1] = codebook.codes.cpu()
        self.live = torch.zeros(rows, dtype=torch.bool)
        self.live[1 : cfg.num_items + 1] = True
        self.ids: list = []  # raw id of added row first_row + j
        self.hashes: list = []
        self.row_of: dict = {}  # raw id -> row of an added item
        self.unplaced: dict = {}  # raw id -> the change that added it, where it could not be placed
        self.trained_index = dict(model._index)  # raw id -> row of a trained item
        # (level-0..L-2 codes as one key) -> collision codes held, as a bit set per prefix
        self._held = {}
        self._radix = [int(c) for c in cfg.codebook_sizes]
        trained = self.codes[1 : cfg.num_items + 1]
        for key, last in zip(self._prefix_keys(trained[:, :-1]).tolist(), trained[:, -1].tolist()):
            self._held[key] = self._held.get(key, 0) | (1 << last)
        self._reserve(rows)

    # ---- placing -------------------------------------------------------------------------------
    def _prefix_keys(self, prefixes: torch.Tensor) -> torch.Tensor:
        """[..., L - 1] codes before the collision code -> [...] one int each (mixed radix)."""
        key = torch.zeros(prefixes.shape[:-1], dtype=torch.long)
        for t in range(prefixes.shape[-1]):
            key = key * self._radix[t] + prefixes[..., t]
        return key

    def _assign_ids(self, embeddings: torch.Tensor, held: dict) -> torch.Tensor:
        """Content embeddings [n, E] -> semantic IDs [n, L], each unique among every ID `held` (prefix
        key -> collision codes taken, updated); a row of -1 where an item's nearest prefixes have no
        collision code free."""
        codebook = self.model.codebook
        if not codebook.has_quantizer:
            raise ValueError("this model version kept no quantizer (its semantic IDs were not fit by residual k-means, "
                             "or it was trained before the catalog existed): retrain it to add items")
        options = codebook.quantize(embeddings, alternatives=min(ALTERNATIVES, self._radix[-2]))  # [n, A, L - 1]
        out = torch.full((embeddings.shape[0], codebook.num_levels), -1, dtype=torch.long)
        last_size = self._radix[-1]
        keys = self._prefix_keys(options).tolist()
        for i in range(options.shape[0]):  # one item after the other: each takes a code the next cannot
            for a, key in enumerate(keys[i]):
                taken = held.get(key, 0)
                free = next((c for c in range(last_size) if not taken >> c & 1), None)
                if free is not None:
                    held[key] = taken | (1 << free)
                    out[i, :-1], out[i, -1] = options[i, a], free
                    break
        return out

    def unplaceable(self, embeddings: np.ndarray) -> list:
        """Which of these new items' content embeddings [n, E] would get no semantic ID now (a dry run:
        the catalog model refuses an add with such items before it commits it)."""
        if not len(embeddings):
            return []
        codes = self._assign_ids(torch.from_numpy(np.asarray(embeddings, np.float32)), dict(self._held))
        return torch.nonzero(codes[:, 0] < 0).squeeze(1).tolist()

    def _release(self, codes: torch.Tensor) -> None:
        key = int(self._prefix_keys(codes[:-1]))
        self._held[key] = self._held.get(key, 0) & ~(1 << int(codes[-1]))

    # ---- applying changes ---------------------------------------------------------------------
    def apply(self, changes: Sequence) -> int:
        """Replay `changes` (consecutive versions after `version`: the catalog store's CatalogChange,
        or anything with its version, adds and retires; an add has item_id, embedding, the content
        embedding in the space the IDs were fit in, and content_hash) onto the model; returns the
        new version. ValueError for a gap in the versions."""
        start = self.version
        try:
            for change in changes:
                if change.version <= self.version:
                    continue  # already applied (a store read overlapping the last one)
                if change.version != self.version + 1:
                    raise ValueError(f"catalog change {change.version} after {self.version}: the changes between are missing")
                self._apply_one(change)
                self.version = change.version
        finally:
            if self.version != start:
                self._publish()
        return self.version

    def _apply_one(self, change) -> None:
        fresh, relisted, replaced = [], [], []
        for item in change.adds:
            row = self.trained_index.get(item.item_id)  # trained in this version: its own row, ID and vector win
            row = self.row_of.get(item.item_id) if row is None else row
            if row is None:
                fresh.append(item)
            elif row >= self.first_row and self.hashes[row - self.first_row] != item.content_hash:
                replaced.append((row, item))
            else:
                relisted.append(row)
        # replay never fails (every stage must reach the same state): an item that cannot be placed (no free
        # semantic ID near its content, or no row left) is left out, and said so, by every stage alike
        for row, _ in replaced:
            self._release(self.codes[row])
        embeddings = [np.asarray(item.embedding, np.float32) for _, item in replaced] + \
                     [np.asarray(item.embedding, np.float32) for item in fresh]
        codes = self._assign_ids(torch.from_numpy(np.stack(embeddings)), self._held) if embeddings else None
        self.live[relisted] = True
        for j, (row, item) in enumerate(replaced):
            if codes[j, 0] < 0:  # its new content finds no free ID: it keeps the one it had
                self._held[self._prefix_keys(self.codes[row, :-1]).item()] |= 1 << int(self.codes[row, -1])
                self.unplaced[item.item_id] = change.version
                continue
            self.codes[row] = codes[j]
            self.hashes[row - self.first_row] = item.content_hash
            self.live[row] = True
            self._embeddings[row] = np.asarray(item.embedding, np.float32)
        for item, item_codes in zip(fresh, codes[len(replaced):] if fresh else ()):
            if item_codes[0] < 0 or len(self.ids) >= self.capacity:
                if item_codes[0] >= 0:  # placed but no row: its ID is free again
                    self._release(item_codes)
                self.unplaced[item.item_id] = change.version
                continue
            row = self.first_row + len(self.ids)
            self.codes[row] = item_codes
            self.live[row] = True
            self.row_of[item.item_id] = row
            self.ids.append(item.item_id)
            self.hashes.append(item.content_hash)
            self._embeddings[row] = np.asarray(item.embedding, np.float32)
            self.unplaced.pop(item.item_id, None)
        for raw in change.retires:
            row = self.trained_index.get(raw, self.row_of.get(raw))
            if row is not None:
                self.live[row] = False

    @property
    def rows_in_use(self) -> int:
        return self.first_row + len(self.ids)

    def _reserve(self, rows: int) -> None:
        """The model's item rows grow to `rows` (zero vectors, no item) once, at load."""
        model = self.model
        backbone = model.backbone
        if backbone is not None:
            weight = backbone.item_embedding.weight
            grown = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            grown[: weight.shape[0]] = weight.detach()
            backbone.item_embedding.weight = nn.Parameter(grown, requires_grad=False)
            backbone.item_embedding.num_embeddings = rows
        model.item_live = self.live.to(model.item_live.device).clone()
        model.rows_in_use = self.first_row
        self._embeddings = {}  # row -> an added item's content embedding, until published

    def _publish(self) -> None:
        """Every place an item lives takes the catalog's state (new tensors, not edits of the ones
        a request may hold)."""
        model = self.model
        n = self.rows_in_use
        added = slice(self.first_row, n)
        if model.backbone is not None and n > self.first_row:
            with torch.no_grad():
                weight = model.backbone.item_embedding.weight
                weight[added] = model.backbone.code_vectors(self.codes[added].to(weight.device))
        content = model.codebook.content
        if content.numel() and self._embeddings:  # grown to the rows in use only: the reserve holds no content
            rows = torch.tensor(list(self._embeddings))
            grown = content.new_zeros(max(n, content.shape[0]), content.shape[1])  # a new table: a request may be
            grown[: content.shape[0]] = content                                      # reading the old one
            grown[rows.to(content.device)] = torch.from_numpy(np.stack(list(self._embeddings.values()))).to(content)
            model.codebook.content = grown
            self._embeddings = {}
        model.item_live = self.live.to(model.item_live.device).clone()
        model.rows_in_use = n
        if model.vocabulary_size:  # stages that read or write raw ids
            model.add_vocabulary(self.ids, self.first_row)
        model.codebook.register_buffer("codes", self.codes[:n].to(model.codebook.codes.device))
        if model.decoder is not None:
            self._publish_decoder()

    def _publish_decoder(self) -> None:
        """The valid-prefix tables over the live items (trained prefixes keep their ids, new ones
        come after them), and node vectors for the prefixes (zero for new ones)."""
        codebook, decoder = self.model.codebook, self.model.decoder
        L, n = codebook.num_levels, self.rows_in_use
        codes, live = self.codes[:n], self.live[:n]
        trained_rows = self._trained_prefixes.shape[0]
        placed = (codes >= 0).all(1)
        added = placed & (torch.arange(n) >= trained_rows)
        use = placed & live
        prefix = torch.zeros(n, dtype=torch.long)
        counts = [1]
        for t in range(L):
            trained = self._trained_children[t]
            size = trained.shape[1]
            nxt = torch.full((n,), -1, dtype=torch.long)
            nxt[:trained_rows] = self._trained_prefixes[:, t + 1]
            known = added & (prefix < trained.shape[0])
            nxt[known] = trained[prefix[known], codes[known, t]]
            new = added & (nxt < 0)
            base = self._trained_count(t + 1)
            total = base
            if bool(new.any()):
                uniq, inverse = torch.unique(prefix[new] * size + codes[new, t], return_inverse=True)
                nxt[new] = base + inverse
                total = base + uniq.numel()
            child = torch.full((counts[-1], size), -1, dtype=torch.long)
            child[prefix[use], codes[use, t]] = nxt[use]
            codebook.register_buffer(f"child_{t}", child.to(codebook.codes.device))
            counts.append(total)
            prefix = nxt
        leaf = torch.zeros(counts[-1], dtype=torch.long)
        leaf[prefix[use]] = torch.arange(n)[use]
        codebook.register_buffer("leaf_item", leaf.to(codebook.codes.device))
        codebook._build_decode_tables()
        for t, trained in self._trained_nodes.items():  # step t's node ids are level-(t+1) prefixes
            extra = counts[int(t) + 1] - (trained.shape[0] - 1)
            table = torch.cat([trained[:-1], trained.new_zeros(extra + 1, trained.shape[1])])
            emb = decoder.node_emb[t]
            emb.weight = nn.Parameter(table, requires_grad=False)
            emb.num_embeddings, emb.padding_idx = table.shape[0], table.shape[0] - 1
        decoder._blocks.clear()

    def _trained_count(self, level: int) -> int:
        """How many level-`level` prefixes the trained codebook has (level L: its items' final prefixes)."""
        L = len(self._trained_children)
        return self._trained_children[level].shape[0] if level < L else int(self._trained_prefixes[:, L].max()) + 1
