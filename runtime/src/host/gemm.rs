//! Matrix products on host slices. They go to the `gemm` crate (candle's GEMM: packed
//! AVX2/AVX-512 FMA kernels chosen at run time, with small-matrix kernels), which takes
//! arbitrary strides, so transposed operands cost nothing; products of bf16 values the plan
//! chose to multiply as bf16 pairs go to [`super::bf16`]. Large products are cut into bands,
//! one per thread, each element the same dot product on any number of threads.

use super::float::{each, post_all, HostFloat, Post};
use crate::kernel::Products;

/// `C = A B` (`beta` as in [`HostFloat::gemm`]) on `threads` threads: cut into as many
/// bands of rows of `C` (or of columns, when it has more columns than rows) as there are
/// threads, each band a product of its own on one thread. Each band still has more than 64
/// rows (columns), so the GEMM blocks its contraction as it does the whole product's, and every
/// element of `C` is the same dot product, summed in the same order, on any number of threads.
/// (The GEMM's own threading ran these products at 1.4x on two threads: its threads share
/// the packing of each block and meet between blocks.)
///
/// # Safety
/// As [`HostFloat::gemm`].
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_oriented<F: HostFloat>(
    m: usize,
    k: usize,
    n: usize,
    a: *const F,
    rsa: isize,
    csa: isize,
    b: *const F,
    rsb: isize,
    csb: isize,
    beta: F,
    c: *mut F,
    rsc: isize,
    csc: isize,
    threads: usize,
    pr: Products,
) {
    oriented(m, k, n, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc, threads, pr, None)
}

/// What a product calls as it finishes rows of `C`: `(first row, rows)`, every row exactly
/// once, after the product last writes it (see [`matmul`]'s `post`).
type RowsDone<'a> = Option<&'a (dyn Fn(usize, usize) + Sync)>;

/// [`gemm_oriented`], calling `rows_done` for every row of `C` once it is final: as each strip
/// is finished on AMX tiles (a product not turned around), else for each band (of rows) or
/// the whole (bands of columns) after its product.
///
/// # Safety
/// As [`gemm_oriented`]; `rows_done` may touch only the rows of `C` it is given.
#[allow(clippy::too_many_arguments)]
unsafe fn oriented<F: HostFloat>(
    m: usize,
    k: usize,
    n: usize,
    a: *const F,
    rsa: isize,
    csa: isize,
    b: *const F,
    rsb: isize,
    csb: isize,
    beta: F,
    c: *mut F,
    rsc: isize,
    csc: isize,
    threads: usize,
    pr: Products,
    rows_done: RowsDone,
) {
    let along = m.max(n);
    let mut bands = threads.min(along / MIN_BAND);
    // The last band is the shortest.
    while bands >= 2 && along - along.div_ceil(bands) * (bands - 1) < MIN_BAND {
        bands -= 1;
    }
    if bands < 2 {
        return gemm_turned(m, k, n, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc, threads, pr, rows_done);
    }
    /// The operands' addresses, shared by the bands (each writes its own part of `C`).
    struct Ptrs<F>(*const F, *const F, *mut F);
    // SAFETY: the bands read `A` and `B` and write disjoint parts of `C`.
    unsafe impl<F> Sync for Ptrs<F> {}
    let p = Ptrs(a, b, c);
    let p = &p;
    let per = along.div_ceil(bands);
    each((0..along).step_by(per).collect(), |lo| {
        let len = per.min(along - lo);
        // SAFETY: band `lo..lo + len` of `C`'s rows (columns) and of `A`'s rows (`B`'s
        // columns) lie inside the caller's views.
        unsafe {
            if m >= n {
                // The band's rows are rows `lo..` of the whole.
                let shifted = rows_done.map(|done| move |r: usize, rows: usize| done(lo + r, rows));
                let done = shifted.as_ref().map(|f| f as &(dyn Fn(usize, usize) + Sync));
                gemm_turned(
                    len,
                    k,
                    n,
                    p.0.offset(lo as isize * rsa),
                    rsa,
                    csa,
                    p.1,
                    rsb,
                    csb,
                    beta,
                    p.2.offset(lo as isize * rsc),
                    rsc,
                    csc,
                    1,
                    pr,
                    done,
                )
            } else {
                gemm_turned(
                    m,
                    k,
                    len,
                    p.0,
                    rsa,
                    csa,
                    p.1.offset(lo as isize * csb),
                    rsb,
                    csb,
                    beta,
                    p.2.offset(lo as isize * csc),
                    rsc,
                    csc,
                    1,
                    pr,
                    None,
                )
            }
        }
    });
    // Bands of columns finish every row together.
    if let Some(done) = rows_done.filter(|_| m < n) {
        done(0, m);
    }
}

/// The fewest rows (columns) in a band of [`gemm_oriented`]: the GEMM takes products with at
/// most 64 rows and 64 columns down another path, which blocks a contraction over more than
/// 512 differently; bands of 80 or more are cut finely enough.
const MIN_BAND: usize = 80;

/// `C = A B` as [`gemm_oriented`], computed as `C^T = B^T A^T` when that wastes less of the
/// micro-kernel's tiles: the f32 GEMM's register tile is 64 bytes of rows (16 f32) by 6
/// columns, so a product with few rows (a convolution's 6 output channels) runs faster turned
/// around; the bf16 pairs' is 8 rows by 32 columns, AMX's 16 by 32. The arithmetic per element
/// of `C` is the same dot product either way. Products of bf16 values (`pr`) on f32 run on
/// [`super::amx`] where the core has AMX tiles, else on [`super::bf16`], one thread per call
/// (the bands of [`gemm_oriented`] share the work).
///
/// # Safety
/// As [`HostFloat::gemm`].
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_turned<F: HostFloat>(
    m: usize,
    k: usize,
    n: usize,
    a: *const F,
    rsa: isize,
    csa: isize,
    b: *const F,
    rsb: isize,
    csb: isize,
    beta: F,
    c: *mut F,
    rsc: isize,
    csc: isize,
    threads: usize,
    pr: Products,
    rows_done: RowsDone,
) {
    let bf16 = pr == Products::Bf16 && std::any::TypeId::of::<F>() == std::any::TypeId::of::<f32>();
    // The micro-kernel's register tile: rows and columns of `C`.
    let amx = bf16 && super::bf16_on_amx();
    let (mr, nr) = match (bf16, amx) {
        #[cfg(target_arch = "x86_64")]
        (_, true) => super::amx::TILE,
        (true, _) => super::bf16::TILE,
        _ => (64 / std::mem::size_of::<F>(), 6),
    };
    let padded = |m: usize, n: usize| m.div_ceil(mr) * mr * n.div_ceil(nr) * nr;
    // Whether the product called `done` for its strips (only the tiles' kernel does).
    let product = |m, n, a: *const F, rsa, csa, b: *const F, rsb, csb, rsc, csc, done: Option<&dyn Fn(usize, usize)>| -> bool {
        if bf16 {
            let (a, b, c) = (a as *const f32, b as *const f32, c as *mut f32);
            let beta = if beta == F::ZERO { 0.0 } else { 1.0 };
            // SAFETY: as the caller's; plans choose bf16 products only where `bf16::available()`,
            // and the tiles run only where `amx::available()`.
            #[cfg(target_arch = "x86_64")]
            if amx {
                unsafe { super::amx::gemm(m, k, n, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc, done) };
                return done.is_some();
            }
            unsafe { super::bf16::gemm(m, k, n, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
        } else {
            // SAFETY: as the caller's.
            unsafe { F::gemm(m, k, n, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc, threads) }
        }
        false
    };
    // Turned around, the product's strips are columns of `C`: its rows are done at the end.
    let strips = if 4 * padded(n, m) < 3 * padded(m, n) {
        product(n, m, b, csb, rsb, a, csa, rsa, csc, rsc, None)
    } else {
        product(m, n, a, rsa, csa, b, rsb, csb, rsc, csc, rows_done.map(|f| f as &dyn Fn(usize, usize)))
    };
    if let Some(done) = rows_done.filter(|_| !strips) {
        done(0, m);
    }
}

/// A row-major `[rows, cols]` matrix view, possibly read transposed.
#[derive(Clone, Copy)]
pub struct Mat<'a, F> {
    pub data: &'a [F],
    pub rows: usize,
    pub cols: usize,
    pub transposed: bool,
}

impl<F> Mat<'_, F> {
    /// Extents as read: `[rows, cols]`, swapped when transposed.
    fn logical(&self) -> (usize, usize) {
        if self.transposed {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
    /// Row and column strides as read.
    fn strides(&self) -> (isize, isize) {
        if self.transposed {
            (1, self.cols as isize)
        } else {
            (self.cols as isize, 1)
        }
    }
}

/// `op(a) @ op(b)` into the row-major `c` (every element written), then `post` (an epilogue)
/// over all of `c`. On AMX tiles `post` runs over each strip of 32 rows as the product
/// finishes it, while the strip is in cache: a `[1024, 512]` output is then not read back
/// from memory and written again by a pass of its own (the elementwise epilogue computes
/// each element alone, so the bits are the same either way).
pub fn matmul<F: HostFloat>(a: Mat<F>, b: Mat<F>, c: &mut [F], p: Products, post: Post<F>) {
    let ((m, k), (k2, n)) = (a.logical(), b.logical());
    assert_eq!(k, k2, "contracting extents checked by shape inference");
    assert!(a.data.len() >= a.rows * a.cols && b.data.len() >= b.rows * b.cols && c.len() == m * n);
    if k == 0 {
        c.fill(F::ZERO);
        return post_all(post, c);
    }
    let ((rsa, csa), (rsb, csb)) = (a.strides(), b.strides());
    // Products of 4 M multiply-adds or more use every thread of the pool (the GEMM splits
    // rows and columns, never the contraction: the same bits on any number of threads).
    let threads = if m * k * n >= 1 << 22 { rayon::current_num_threads() } else { 1 };
    /// `C`'s first element, for the rows a product hands over.
    struct Out<F>(*mut F);
    // SAFETY: each call of `rows_done` gets rows no other call and no product writes any more.
    unsafe impl<F> Sync for Out<F> {}
    let out = Out(c.as_mut_ptr());
    let out = &out;
    // `post` over rows `r..r + rows`, which start at element `r * n` of the whole.
    let rows_done = post.map(|post| {
        move |r: usize, rows: usize| {
            // SAFETY: rows `r..r + rows` of the m x n `C` are final (see `oriented`) and lie in `c`.
            let part = unsafe { std::slice::from_raw_parts_mut(out.0.add(r * n), rows * n) };
            post_all(Some(&|first, q: &mut [F]| post(r * n + first, q)), part)
        }
    });
    let done = rows_done.as_ref().map(|f| f as &(dyn Fn(usize, usize) + Sync));
    // SAFETY: both views were checked to lie inside their slices; `c` is m x n.
    unsafe { oriented::<F>(m, k, n, a.data.as_ptr(), rsa, csa, b.data.as_ptr(), rsb, csb, F::ZERO, out.0, n as isize, 1, threads, p, done) };
}

/// `batch` products `op(a_i) @ op(b_i)` of `m x k` by `k x n`, each operand's matrices
/// consecutive, into the row-major `c`; the products are shared among the pool's threads.
#[allow(clippy::too_many_arguments)]
pub fn batch_matmul<F: HostFloat>(
    a: &[F],
    b: &[F],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    transpose_a: bool,
    transpose_b: bool,
    c: &mut [F],
    p: Products,
) {
    let (sa, sb) = (m * k, k * n);
    let (ra, ca) = if transpose_a { (k, m) } else { (m, k) };
    let (rb, cb) = if transpose_b { (n, k) } else { (k, n) };
    let one = |(i, c): (usize, &mut [F])| {
        let lhs = Mat { data: &a[i * sa..(i + 1) * sa], rows: ra, cols: ca, transposed: transpose_a };
        let rhs = Mat { data: &b[i * sb..(i + 1) * sb], rows: rb, cols: cb, transposed: transpose_b };
        matmul(lhs, rhs, c, p, None);
    };
    if rayon::current_num_threads() > 1 && batch > 1 {
        use rayon::prelude::*;
        c.par_chunks_exact_mut(m * n).take(batch).enumerate().for_each(one);
    } else {
        c.chunks_exact_mut(m * n).take(batch).enumerate().for_each(one);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::float::tests::{data, new};

    /// Products cut into bands of rows or of columns, one per thread, have the bits of the
    /// whole product on one thread: tall and wide ones, contractions over more than 512 (which
    /// the GEMM blocks differently in products of at most 64 x 64), operands read transposed,
    /// on one to four threads.
    #[test]
    fn banded_products_have_the_bits_of_the_whole_product() {
        // (m, k, n): bands of rows; of columns; 160 rows over 40 columns in two bands of 80;
        // 150 and 170 not cut into bands of 64 or fewer (by 40, they would block their
        // contraction of 700 in pieces of 512).
        for (m, k, n) in [(1024, 128, 512), (128, 1024, 512), (160, 700, 40), (150, 700, 40), (40, 700, 170)] {
            for (ta, tb) in [(false, false), (true, false), (false, true)] {
                let (a, b) = (data(m * k, m), data(k * n, n));
                let ma =
                    if ta { Mat { data: &a, rows: k, cols: m, transposed: true } } else { Mat { data: &a, rows: m, cols: k, transposed: false } };
                let mb =
                    if tb { Mat { data: &b, rows: n, cols: k, transposed: true } } else { Mat { data: &b, rows: k, cols: n, transposed: false } };
                let one: Vec<u32> = new(m * n, |c| matmul(ma, mb, c, Products::F32, None)).into_iter().map(f32::to_bits).collect();
                for threads in [2, 3, 4] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
                    let got: Vec<u32> =
                        pool.install(|| new(m * n, |c| matmul(ma, mb, c, Products::F32, None))).into_iter().map(f32::to_bits).collect();
                    assert!(got == one, "{m}x{k}x{n} (transposed {ta}, {tb}) on {threads} threads");
                }
            }
        }
    }

    /// An epilogue handed to the product (`post`) has the bits of the product followed by the
    /// epilogue over all of `C`, each element posted exactly once at its own index: on AMX
    /// tiles (strips, with a last strip of fewer than 32 rows, two blocks of `k` and of
    /// columns), on the bf16 pairs and in f32, turned products, bands of rows and of columns
    /// on one to three threads.
    #[test]
    fn an_epilogue_in_the_product_has_the_bits_of_one_after_it() {
        let products = if crate::host::bf16::available() { vec![Products::F32, Products::Bf16] } else { vec![Products::F32] };
        // (m, k, n): a last strip of 6 rows; bands of rows over two blocks of `k` (the tiles'
        // are 768); bands of rows over two blocks of columns (512); bands of columns; few
        // columns, turned around in bands of rows on the tiles; few rows, turned in f32.
        for (m, k, n) in [(70, 96, 40), (300, 800, 100), (600, 64, 520), (200, 800, 600), (300, 64, 6), (6, 64, 300)] {
            let (a, b, extra) = (data(m * k, m), data(k * n, n), data(m * n, 7));
            let ma = Mat { data: &a, rows: m, cols: k, transposed: false };
            let mb = Mat { data: &b, rows: n, cols: k, transposed: true };
            // Depends on the element's index: a part posted at the wrong place, or twice, shows.
            let post = |first: usize, part: &mut [f32]| part.iter_mut().enumerate().for_each(|(i, v)| *v = *v * 0.5 + extra[first + i]);
            for p in products.iter().copied() {
                let mut want = new(m * n, |c| matmul(ma, mb, c, p, None));
                post(0, &mut want);
                for threads in [1, 2, 3] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
                    let got = pool.install(|| new(m * n, |c| matmul(ma, mb, c, p, Some(&post))));
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert!(bits(&got) == bits(&want), "{m}x{k}x{n}, {p:?} products, on {threads} threads");
                }
            }
        }
    }
}
