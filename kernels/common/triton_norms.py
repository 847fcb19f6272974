"""The row math the Triton norm kernels share, as @triton.jit helpers that Triton inlines into
each kernel: RMSNorm and LayerNorm of a [SPLIT, ROWS, CHUNK] tile held in registers as fp32 (the
row read once), and the residual sum the fused-add kernels store and then normalise."""

from __future__ import annotations

from fusionlab.kernels.common.triton_tiles import triton

if triton is not None:
    import triton.language as tl

    from fusionlab.kernels.common.triton_tiles import load_columns, load_rows, row_sum, store_rows

    @triton.jit
    def rstd_of(v, n_cols, eps):
        """rsqrt(mean(v^2) + eps) per row as [1, ROWS, 1]; v's padding lanes must be 0."""
        return tl.rsqrt(row_sum(v * v) / n_cols + eps)

    @triton.jit
    def centred(v, col_mask, n_cols):
        """v minus its row mean (around the mean, never E[v^2] - E[v]^2), 0 in padding columns
        so that they add no (0 - mean)^2 to the variance."""
        mean = row_sum(v) / n_cols
        return tl.where(col_mask, v - mean, 0.0)

    @triton.jit
    def rms_norm_tile(v, w_ptr, cols, col_mask, n_cols, eps):
        """v * rsqrt(mean(v^2) + eps) * w over a tile of rows."""
        rstd = rstd_of(v, n_cols, eps)
        w = load_columns(w_ptr, cols, col_mask)
        return v * rstd * w

    @triton.jit
    def layer_norm_tile(v, w_ptr, b_ptr, cols, col_mask, n_cols, eps):
        """(v - mean) * rsqrt(var + eps) * w + b over a tile of rows, biased variance."""
        vc = centred(v, col_mask, n_cols)
        rstd = rstd_of(vc, n_cols, eps)
        w = load_columns(w_ptr, cols, col_mask)
        b = load_columns(b_ptr, cols, col_mask)
        return vc * rstd * w + b

    @triton.jit
    def residual_sum(x_ptr, r_ptr, s_ptr, rows, x_row_stride, r_row_stride, s_row_stride, cols,
                     mask):
        """x + r formed in fp32 and stored to s (in s's dtype); the fp32 sum is returned."""
        x = load_rows(x_ptr, rows, x_row_stride, cols, mask)
        r = load_rows(r_ptr, rows, r_row_stride, cols, mask)
        s = x + r
        # Stored before any reduction so the in-place flavour never reads what it overwrote:
        # every element is loaded above, by the program that alone writes its row.
        store_rows(s_ptr, rows, s_row_stride, cols, s, mask)
        return s
