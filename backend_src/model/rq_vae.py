"""A learned residual quantizer (RQ-VAE) for semantic IDs, as in "Recommender Systems with Generative
Retrieval": an MLP encoder maps an item embedding x to a latent z; L levels of codebooks quantize z
residually,

    r_0 = z,  c_l = argmin_k |r_l - e^l_k|,  r_{l+1} = r_l - e^l_{c_l},  z_q = sum_l e^l_{c_l},

and an MLP decoder reconstructs x from z_q (gradients pass the quantizer straight through). Loss:

    |x - dec(z_q)|^2 + beta sum_l |r_l - sg[e^l_{c_l}]|^2.

Unlike residual k-means, the latent space is learned with the codes, so the quantizer can trade
reconstruction of x for codes it can represent. The codebooks follow their residuals by exponential
moving averages of the residuals each code is assigned ("Neural Discrete Representation Learning",
appendix): a codebook loss with Adam lags the growing latents on a short CPU budget. They start from
residual k-means of the first latents; a code no item uses is re-seeded on a random residual of
its level.

Optionally the codes are also asked to carry collaborative signal, as in "Learnable Item Tokenization
for Generative Recommendation": a contrastive term pulls a projection of each item's z_q toward that
item's collaborative embedding h and away from the other items' of the batch,

    - lambda * mean_i log softmax_j( <W z_q_i, h_j> / tau )_i   (both sides unit norm).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend_src.model.kmeans import kmeans, sq_dists


def _mlp(sizes) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class RQVAE(nn.Module):
    def __init__(self, in_dim: int, sizes=(256, 256, 256), latent_dim: int = 32, hidden=(256, 128), beta: float = 0.25,
                 decay: float = 0.99, align_dim: int = 0, align_weight: float = 0.0, temperature: float = 0.1):
        super().__init__()
        self.encoder = _mlp((in_dim, *hidden, latent_dim))
        self.decoder = _mlp((latent_dim, *reversed(hidden), in_dim))
        self.to_aligned = nn.Linear(latent_dim, align_dim) if align_dim else None
        self.align_weight, self.temperature = align_weight, temperature
        self.codebooks = [torch.zeros(s, latent_dim) for s in sizes]
        self._ema_count = [torch.zeros(s) for s in sizes]
        self._ema_sum = [torch.zeros(s, latent_dim) for s in sizes]
        self.beta, self.decay = beta, decay

    def quantize(self, z: torch.Tensor):
        """z [n, latent] -> (codes [n, L], z_q [n, latent], commitment loss, residuals [L, n, latent]).
        In training mode each codebook moves toward the mean residual of its codes (EMA)."""
        residual, zq, loss = z, torch.zeros_like(z), z.new_zeros(())
        codes, residuals = [], []
        for level, book in enumerate(self.codebooks):
            r = residual.detach()
            c = sq_dists(r, book).argmin(1)
            if self.training:
                self._ema_update(level, c, r)
            e = book[c]
            loss = loss + self.beta * (residual - e).pow(2).sum(1).mean()
            zq = zq + e
            residual = residual - e
            codes.append(c)
            residuals.append(r)
        return torch.stack(codes, 1), zq, loss, torch.stack(residuals)

    @torch.no_grad()
    def _ema_update(self, level: int, codes: torch.Tensor, r: torch.Tensor):
        k = self.codebooks[level].shape[0]
        count, total = self._ema_count[level], self._ema_sum[level]
        count.mul_(self.decay).add_(torch.bincount(codes, minlength=k).float(), alpha=1 - self.decay)
        total.mul_(self.decay).add_(torch.zeros_like(total).index_add_(0, codes, r), alpha=1 - self.decay)
        n = count.sum()
        smoothed = (count + 1e-5) / (n + k * 1e-5) * n  # Laplace smoothing: no division by 0
        self.codebooks[level] = total / smoothed[:, None]

    def forward(self, x: torch.Tensor, aligned: torch.Tensor | None = None):
        """x [n, D] (and, with an alignment head, the items' unit collaborative embeddings [n, D'])
        -> (codes [n, L], loss, residuals [L, n, latent])."""
        z = self.encoder(x)
        codes, zq, loss, residuals = self.quantize(z)
        zq = z + (zq - z).detach()  # straight-through: the decoder's gradient reaches the encoder
        loss = loss + (x - self.decoder(zq)).pow(2).sum(1).mean()
        if aligned is not None and self.to_aligned is not None:
            logits = F.normalize(self.to_aligned(zq), dim=1) @ aligned.T / self.temperature
            loss = loss + self.align_weight * F.cross_entropy(logits, torch.arange(len(x)))
        return codes, loss, residuals

    @torch.no_grad()
    def init_codebooks(self, x: torch.Tensor, seed: int = 0):
        """Each level's codebook <- k-means of that level's residuals of the current latents."""
        residual = self.encoder(x)
        for level, book in enumerate(self.codebooks):
            assign, centers = kmeans(residual, book.shape[0], iters=10, seed=seed + level)
            book.copy_(centers[torch.arange(book.shape[0]) % centers.shape[0]])
            self._ema_sum[level].copy_(book)
            self._ema_count[level].fill_(1.0)
            residual = residual - book[assign]

    @torch.no_grad()
    def reseed_unused(self, codes: torch.Tensor, residuals: torch.Tensor, gen: torch.Generator) -> int:
        """Codes [n, L] and residuals [L, n, latent] of every item: each code no item uses moves to a
        random item's residual at its level. Returns how many codes moved."""
        moved = 0
        for level, book in enumerate(self.codebooks):
            unused = torch.bincount(codes[:, level], minlength=book.shape[0]) == 0
            k = int(unused.sum())
            if k:
                pick = torch.randint(residuals.shape[1], (k,), generator=gen)
                book[unused] = residuals[level, pick]
                self._ema_sum[level][unused] = book[unused]
                self._ema_count[level][unused] = 1.0
                moved += k
        return moved


@torch.no_grad()
def _every_item(model: RQVAE, x: torch.Tensor):
    """(codes, loss, residuals) of all items under the current weights, without moving the codebooks."""
    model.eval()
    out = model(x)
    model.train()
    return out


def rq_vae_codes(x: torch.Tensor, sizes=(256, 256, 256), steps: int = 3000, batch_size: int = 1024, lr: float = 1e-3,
                 reseed_every: int = 250, seed: int = 0, aligned: torch.Tensor | None = None, align_weight: float = 0.1,
                 log=None) -> torch.Tensor:
    """Item embeddings x [I, D] -> codes [I, len(sizes)] from an RQ-VAE trained `steps` steps of
    Adam on random batches of items (unused codes re-seeded every `reseed_every` steps but the
    last stretch, so the final codebooks are trained ones). aligned [I, D']: the items'
    collaborative embeddings the codes are also pulled toward, at `align_weight`."""
    x = x.float()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    sizes = tuple(min(s, x.shape[0]) for s in sizes)
    if aligned is not None:
        aligned = F.normalize(aligned.float(), dim=1)
    model = RQVAE(x.shape[1], sizes, align_dim=0 if aligned is None else aligned.shape[1], align_weight=align_weight)
    model.init_codebooks(x, seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(1, steps + 1):
        rows = torch.randint(x.shape[0], (min(batch_size, x.shape[0]),), generator=gen)
        _, loss, _ = model(x[rows], None if aligned is None else aligned[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % reseed_every == 0 and step <= steps - reseed_every:
            codes, full_loss, residuals = _every_item(model, x)
            moved = model.reseed_unused(codes, residuals, gen)
            if log is not None:
                log(f"  rq-vae step {step}: loss {float(full_loss):.4f}, {moved} unused codes re-seeded")
    codes, full_loss, _ = _every_item(model, x)
    if log is not None:
        log(f"  rq-vae: loss {float(full_loss):.4f}, codes used per level "
            f"{[int(codes[:, l].unique().numel()) for l in range(codes.shape[1])]}")
    return codes
