"""Per-sample images in a batch of rows: pure functions on the three tensors that carry them.

A rollout batch's images (:mod:`nanogrpo.batch`) are ``pixel_values`` (P, D) float32 patch rows,
``image_grid_thw`` (I, 3) int64 (t, h, w) per image, and ``image_counts`` (N,) int64 images per
sequence; sequence 0's images come first, then sequence 1's, and each image's t*h*w patch rows in
the same order. Micro-batches select whole sequences, so their images go with them
(:func:`select_rows`), never mixed across rows; the G samples of a group carry the same images,
which a forward may compute once (:func:`distinct_rows`).
"""

from __future__ import annotations

import torch


def image_patches(grid: torch.Tensor) -> torch.Tensor:
    """(I,) int64: patch rows per image."""
    return grid.prod(-1) if grid.numel() else torch.zeros(0, dtype=torch.int64)


def row_offsets(grid: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """((N + 1,) first image of each row, (I + 1,) first patch row of each image): cumulative offsets."""
    img = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    img[1:] = counts.cpu().cumsum(0)
    pat = torch.zeros(grid.shape[0] + 1, dtype=torch.int64)
    pat[1:] = image_patches(grid.cpu()).cumsum(0)
    return img, pat


def select_rows(pixel_values: torch.Tensor, grid: torch.Tensor, counts: torch.Tensor,
                rows: torch.Tensor | list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The images of sequences ``rows`` (in that order): (pixel_values (P', D), grid (I', 3), counts (n,))."""
    rows = torch.as_tensor(rows, dtype=torch.int64).cpu().tolist()
    img, pat = row_offsets(grid, counts)
    img_idx: list[int] = []
    for r in rows:
        img_idx.extend(range(int(img[r]), int(img[r + 1])))
    pat_idx: list[int] = []
    for i in img_idx:
        pat_idx.extend(range(int(pat[i]), int(pat[i + 1])))
    dev = pixel_values.device
    pv = pixel_values[torch.tensor(pat_idx, dtype=torch.int64, device=dev)] if pat_idx \
        else pixel_values[:0]                                                         # (P', D)
    g = grid[torch.tensor(img_idx, dtype=torch.int64, device=grid.device)] if img_idx else grid[:0]  # (I', 3)
    return pv, g, counts[torch.tensor(rows, dtype=torch.int64, device=counts.device)]


def concat(parts: list[tuple[torch.Tensor, torch.Tensor]], dim: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """One batch's (pixel_values, grid, counts) from each sequence's (pixel_values (P_i, D),
    grid (I_i, 3))."""
    pv = torch.cat([p for p, _ in parts]) if parts else torch.zeros(0, dim)
    g = torch.cat([g for _, g in parts]) if parts else torch.zeros(0, 3, dtype=torch.int64)
    counts = torch.tensor([int(g.shape[0]) for _, g in parts], dtype=torch.int64)
    return pv.float().contiguous(), g.to(torch.int64).contiguous(), counts


def distinct_rows(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each distinct group (U,), each row's index into them (N,)): rows of one group share
    their prompt and its images, so the image features of the U first rows serve all N."""
    uniq, inv = torch.unique(group_ids.cpu(), return_inverse=True)
    first = torch.full((uniq.numel(),), -1, dtype=torch.int64)
    for i, u in enumerate(inv.tolist()):
        if first[u] < 0:
            first[u] = i
    return first, inv


def check_images(pixel_values: torch.Tensor, grid: torch.Tensor, counts: torch.Tensor, n: int,
                 max_patches: int | None = None, max_images: int | None = None) -> str | None:
    """The first defect of a batch's image tensors as one line, or None: dtypes, shapes, the patch
    count the grids imply, per-sequence counts that add up, caps."""
    if pixel_values.dtype != torch.float32 or pixel_values.dim() != 2:
        return f"pixel_values must be 2-D float32, got {pixel_values.dtype} {tuple(pixel_values.shape)}"
    if grid.dtype != torch.int64 or grid.dim() != 2 or grid.shape[1] != 3:
        return f"image_grid_thw must be (I, 3) int64, got {grid.dtype} {tuple(grid.shape)}"
    if counts.dtype != torch.int64 or tuple(counts.shape) != (n,):
        return f"image_counts must be ({n},) int64, got {counts.dtype} {tuple(counts.shape)}"
    if bool((counts < 0).any()) or int(counts.sum()) != grid.shape[0]:
        return f"image_counts add up to {int(counts.sum())}, but there are {grid.shape[0]} image grids"
    if grid.numel() and bool((grid < 1).any()):
        return "image_grid_thw entries must be >= 1"
    if max_images is not None and counts.numel() and int(counts.max()) > max_images:
        return f"a sequence carries more than {max_images} images"
    total = int(image_patches(grid).sum()) if grid.numel() else 0
    if max_patches is not None and total > max_patches:
        return f"{total} image patches exceed the limit {max_patches}"
    if total != pixel_values.shape[0]:
        return f"the image grids make {total} patch rows, pixel_values has {pixel_values.shape[0]}"
    if not bool(torch.isfinite(pixel_values).all()):
        return "pixel_values holds NaN or inf"
    return None
