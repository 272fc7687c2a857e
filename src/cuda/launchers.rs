//! One launcher per kernel the Rust side launches (see [`super::launch`]), by kernel file in
//! the order of [`super::KERNEL_FILES`]: each struct's fields are its kernels' parameters, in
//! the order and of the kinds kernels/*.cu declares them (the unit test below compares them).
//! A launcher that names several kernels launches any of them: they share the parameter list
//! and differ in tile or load path, chosen at run time.

use super::kernel_types::{ConvArgs, InputMix, RankBuffersF32, RankBuffersF64};
use super::launch::{kernel_launchers, In, Out};

kernel_launchers! {
    // input.cu
    /// u8 NHWC pixels → normalised bf16, augmented and mixed.
    "input.cu" InputTransform<'a> ["input_transform"] {
        src: In<'a, u8>,
        aug: In<'a, i32>,
        use_aug: i32,
        scale: In<'a, f32>,
        shift: In<'a, f32>,
        mix: In<'a, InputMix>,
        dst: Out<'a, u16>,
        n: i32,
        size: i32,
    }

    // conv.cu (v1)
    /// The v1 forward and data-gradient GEMMs: `out = a ⊛ b`.
    "conv.cu" ConvGemm<'a> ["conv_fwd_vec", "conv_fwd_scalar", "conv_dgrad_vec", "conv_dgrad_scalar"] {
        a: In<'a, u16>,
        b: In<'a, u16>,
        out: Out<'a, u16>,
        shape: ConvArgs,
    }
    /// The v1 weight-gradient GEMMs (f32 `dw`, accumulated).
    "conv.cu" ConvWgrad<'a> ["conv_wgrad_vec", "conv_wgrad_stem", "conv_wgrad_scalar"] {
        dy: In<'a, u16>,
        x: In<'a, u16>,
        dw: Out<'a, f32>,
        shape: ConvArgs,
    }

    // conv2.cu (v2)
    /// The v2 forward and data-gradient GEMMs (every tile and gather).
    "conv2.cu" Conv2Gemm<'a> [
        "conv2_fwd_128x128", "conv2_fwd_128x64", "conv2_fwd_1x1_128x128", "conv2_fwd_1x1_128x64",
        "conv2_dgrad_128x128", "conv2_dgrad_128x64", "conv2_dgrad_1x1_128x128",
        "conv2_dgrad_1x1_128x64",
    ] {
        a: In<'a, u16>,
        b: In<'a, u16>,
        out: Out<'a, u16>,
        args: super::conv::Conv2Args,
    }
    /// The v2 weight-gradient GEMMs (f32 `dw`, or one plane per reduction slice).
    "conv2.cu" Conv2Wgrad<'a> [
        "conv2_wgrad_128x128", "conv2_wgrad_64x128", "conv2_wgrad_c8_64x128",
        "conv2_wgrad_1x1_128x128", "conv2_wgrad_1x1_64x128",
    ] {
        dy: In<'a, u16>,
        x: In<'a, u16>,
        dw: Out<'a, f32>,
        args: super::conv::Conv2Args,
    }
    /// The v2 forward GEMMs with the batch-norm statistics epilogue (tile records in `part`).
    "conv2.cu" Conv2FwdStats<'a> [
        "conv2_fwd_stats_128x128", "conv2_fwd_stats_128x64", "conv2_fwd_stats_1x1_128x128",
        "conv2_fwd_stats_1x1_128x64",
    ] {
        x: In<'a, u16>,
        w: In<'a, u16>,
        y: Out<'a, u16>,
        args: super::conv::Conv2Args,
        part: Out<'a, f32>,
    }
    /// The v2 data-gradient GEMMs with the batch-norm gradient epilogue (`residual` null: no
    /// residual gradient). The ReLU mask: from `bn_y` when given, else with `relu` recomputed
    /// from `bn_x` with `gamma` and `beta` (read only then), else none.
    "conv2.cu" Conv2DgradBn<'a> [
        "conv2_dgrad_bn_128x128", "conv2_dgrad_bn_128x64", "conv2_dgrad_bn_1x1_128x128",
        "conv2_dgrad_bn_1x1_128x64",
    ] {
        dy: In<'a, u16>,
        wt: In<'a, u16>,
        dx: Out<'a, u16>,
        args: super::conv::Conv2Args,
        part: Out<'a, f32>,
        bn_y: Option<In<'a, u16>>,
        bn_x: In<'a, u16>,
        mean: In<'a, f32>,
        invstd: In<'a, f32>,
        residual: Option<In<'a, u16>>,
        gamma: Option<In<'a, u16>>,
        beta: Option<In<'a, u16>>,
        relu: i32,
    }
    /// The v2 forward GEMMs reading a batch norm's input `z` and applying the batch norm
    /// (saved `mean`, `invstd`, `gamma`, `beta`, ReLU if `relu`) as they load it.
    "conv2.cu" Conv2FwdApply<'a> [
        "conv2_fwd_apply_128x128", "conv2_fwd_apply_128x64", "conv2_fwd_apply_1x1_128x128",
        "conv2_fwd_apply_1x1_128x64",
    ] {
        z: In<'a, u16>,
        w: In<'a, u16>,
        y: Out<'a, u16>,
        args: super::conv::Conv2Args,
        mean: In<'a, f32>,
        invstd: In<'a, f32>,
        gamma: In<'a, u16>,
        beta: In<'a, u16>,
        relu: i32,
    }
    /// [`Conv2FwdApply`] with the batch-norm statistics epilogue (tile records in `part`).
    "conv2.cu" Conv2FwdStatsApply<'a> [
        "conv2_fwd_stats_apply_128x128", "conv2_fwd_stats_apply_128x64",
        "conv2_fwd_stats_apply_1x1_128x128", "conv2_fwd_stats_apply_1x1_128x64",
    ] {
        z: In<'a, u16>,
        w: In<'a, u16>,
        y: Out<'a, u16>,
        args: super::conv::Conv2Args,
        part: Out<'a, f32>,
        mean: In<'a, f32>,
        invstd: In<'a, f32>,
        gamma: In<'a, u16>,
        beta: In<'a, u16>,
        relu: i32,
    }
    /// The v2 weight-gradient GEMMs reading a batch norm's input `z`, applied as in
    /// [`Conv2FwdApply`] (f32 `dw`, or one plane per reduction slice).
    "conv2.cu" Conv2WgradApply<'a> [
        "conv2_wgrad_apply_128x128", "conv2_wgrad_apply_64x128", "conv2_wgrad_apply_c8_64x128",
        "conv2_wgrad_apply_1x1_128x128", "conv2_wgrad_apply_1x1_64x128",
    ] {
        dy: In<'a, u16>,
        z: In<'a, u16>,
        dw: Out<'a, f32>,
        args: super::conv::Conv2Args,
        mean: In<'a, f32>,
        invstd: In<'a, f32>,
        gamma: In<'a, u16>,
        beta: In<'a, u16>,
        relu: i32,
    }
    /// The weight rearranged into the phase order of the v2 data gradient.
    "conv2.cu" Conv2DgradWeights<'a> ["conv2_dgrad_weights"] {
        w: In<'a, u16>,
        wt: Out<'a, u16>,
        args: super::conv::Conv2Args,
    }
    /// The split weight gradient's planes summed in slice order.
    "conv2.cu" Conv2WgradReduce<'a> ["conv2_wgrad_reduce"] {
        planes: In<'a, f32>,
        dw: Out<'a, f32>,
        len: i64,
        slices: i32,
    }
    /// Rows of pixels as pairs of 4-channel pixels (the stem's input and weight at stride 2).
    "conv2.cu" Conv2PairPixels<'a> ["conv2_pair_pixels"] {
        src: In<'a, u16>,
        dst: Out<'a, u16>,
        rows: i64,
        width: i32,
        c: i32,
        lead: i32,
    }
    /// Rows widened to more channels with zeros (a stem's 3 → 8 at stride 1).
    "conv2.cu" Conv2PadChannels<'a> ["conv2_pad_channels"] {
        src: In<'a, u16>,
        dst: Out<'a, u16>,
        rows: i64,
        c_from: i32,
        c_to: i32,
    }

    // conv3.cu (v3, Hopper: operands through TMA tensor maps)
    /// The v3 forward and data-gradient GEMMs: `out = a · bᵀ` (+ out with `args.accumulate`).
    "conv3.cu" Conv3Gemm<'a> [
        "conv3_fwd_1x1", "conv3_dgrad_1x1", "conv3_fwd_3x3", "conv3_dgrad_3x3",
        "conv3_fwd_1x1_n64", "conv3_dgrad_1x1_n64", "conv3_fwd_3x3_n64", "conv3_dgrad_3x3_n64",
        "conv3_fwd_1x1_p", "conv3_dgrad_1x1_p", "conv3_fwd_3x3_p", "conv3_dgrad_3x3_p",
        "conv3_fwd_1x1_n64_p", "conv3_dgrad_1x1_n64_p", "conv3_fwd_3x3_n64_p",
        "conv3_dgrad_3x3_n64_p",
    ] {
        map_a: super::conv3::TensorMap,
        map_b: super::conv3::TensorMap,
        out: Out<'a, u16>,
        args: super::conv3::Conv3Args,
    }
    /// The v3 forward GEMM with the batch-norm statistics epilogue (tile records in `part`).
    "conv3.cu" Conv3FwdStats<'a> [
        "conv3_fwd_stats_1x1", "conv3_fwd_stats_3x3", "conv3_fwd_stats_1x1_n64",
        "conv3_fwd_stats_3x3_n64", "conv3_fwd_stats_1x1_p", "conv3_fwd_stats_3x3_p",
        "conv3_fwd_stats_1x1_n64_p", "conv3_fwd_stats_3x3_n64_p",
    ] {
        map_x: super::conv3::TensorMap,
        map_w: super::conv3::TensorMap,
        y: Out<'a, u16>,
        args: super::conv3::Conv3Args,
        part: Out<'a, f32>,
    }
    /// The v3 data-gradient GEMM with the batch-norm gradient epilogue (conv2's contract,
    /// [`Conv2DgradBn`]'s mask: from `bn_y`, from `bn_signs` (y's signs packed a bit per
    /// element, [`BnApplySigns`]), or with `relu` recomputed from `bn_x`).
    "conv3.cu" Conv3DgradBn<'a> [
        "conv3_dgrad_bn_1x1", "conv3_dgrad_bn_3x3", "conv3_dgrad_bn_1x1_n64",
        "conv3_dgrad_bn_3x3_n64", "conv3_dgrad_bn_1x1_p", "conv3_dgrad_bn_3x3_p",
        "conv3_dgrad_bn_1x1_n64_p", "conv3_dgrad_bn_3x3_n64_p",
    ] {
        map_dy: super::conv3::TensorMap,
        map_wt: super::conv3::TensorMap,
        dx: Out<'a, u16>,
        args: super::conv3::Conv3Args,
        part: Out<'a, f32>,
        bn_y: Option<In<'a, u16>>,
        bn_x: In<'a, u16>,
        mean: In<'a, f32>,
        invstd: In<'a, f32>,
        residual: Option<In<'a, u16>>,
        gamma: Option<In<'a, u16>>,
        beta: Option<In<'a, u16>>,
        relu: i32,
        bn_signs: Option<In<'a, u8>>,
    }
    /// The v3 weight gradient: one f32 plane per reduction slice.
    "conv3.cu" Conv3Wgrad<'a> [
        "conv3_wgrad_1x1", "conv3_wgrad_3x3", "conv3_wgrad_1x1_n64", "conv3_wgrad_3x3_n64",
        "conv3_wgrad_1x1_m64", "conv3_wgrad_3x3_m64",
    ] {
        map_dy: super::conv3::TensorMap,
        map_x: super::conv3::TensorMap,
        dw: Out<'a, f32>,
        args: super::conv3::Conv3Args,
    }
    /// The weight rearranged for the v3 3×3 data gradient (`[C][taps·K]`).
    "conv3.cu" Conv3DgradWeights3x3<'a> ["conv3_dgrad_weights_3x3"] {
        w: In<'a, u16>,
        wt: Out<'a, u16>,
        k_out: i32,
        taps: i32,
        c_in: i32,
    }
    /// The weight rearranged per phase for the v3 stride-2 3×3 data gradient
    /// (`[4 phases][C][4 taps·K]`).
    "conv3.cu" Conv3DgradWeightsS2<'a> ["conv3_dgrad_weights_s2"] {
        w: In<'a, u16>,
        wt: Out<'a, u16>,
        k_out: i32,
        c_in: i32,
    }
    /// The weight transposed for the v3 data gradient.
    "conv3.cu" Conv3TransposeWeights<'a> ["conv3_transpose_weights"] {
        w: In<'a, u16>,
        wt: Out<'a, u16>,
        rows: i32,
        cols: i32,
    }

    // bn.cu
    /// Per-slab mean and M2 of each channel.
    "bn.cu" BnStatsPartial<'a> ["bn_stats_partial", "bn_stats_partial_vec"] {
        x: In<'a, u16>,
        rows: i32,
        channels: i32,
        rows_per_slab: i32,
        part_mean: Out<'a, f32>,
        part_m2: Out<'a, f32>,
    }
    /// The slabs merged: saved mean, 1/std and the running statistics.
    "bn.cu" BnStatsFinalize<'a> ["bn_stats_finalize"] {
        part_mean: In<'a, f32>,
        part_m2: In<'a, f32>,
        slabs: i32,
        rows: i32,
        channels: i32,
        rows_per_slab: i32,
        eps: f32,
        momentum: f32,
        mean_out: Out<'a, f32>,
        invstd_out: Out<'a, f32>,
        running_mean: Out<'a, f32>,
        running_var: Out<'a, f32>,
    }
    /// Mean and 1/std from the running statistics (frozen and eval mode).
    "bn.cu" BnEvalPrepare<'a> ["bn_eval_prepare"] {
        running_mean: In<'a, f32>,
        running_var: In<'a, f32>,
        channels: i32,
        eps: f32,
        mean_out: Out<'a, f32>,
        invstd_out: Out<'a, f32>,
    }
    /// y = γ·x̂ + β (+ residual), then the ReLU when `relu` is 1.
    "bn.cu" BnApply<'a> ["bn_apply", "bn_apply_vec"] {
        x: In<'a, u16>,
        mean: In<'a, f32>,
        invstd: In<'a, f32>,
        gamma: In<'a, u16>,
        beta: In<'a, u16>,
        residual: Option<In<'a, u16>>,
        y: Out<'a, u16>,
        total: i64,
        channels: i32,
        relu: i32,
    }
    /// [`BnApply`]'s 16-byte kernel that also packs y's signs a bit per element (bit e of
    /// `signs[i / 8]`: y[8·(i / 8) + e] > 0), for the data gradients that read the ReLU's mask.
    "bn.cu" BnApplySigns<'a> ["bn_apply_signs_vec"] {
        x: In<'a, u16>,
        mean: In<'a, f32>,
        invstd: In<'a, f32>,
        gamma: In<'a, u16>,
        beta: In<'a, u16>,
        residual: Option<In<'a, u16>>,
        y: Out<'a, u16>,
        signs: Out<'a, u8>,
        total: i64,
        channels: i32,
        relu: i32,
    }
    /// Synchronised BN: this replica's moments as sums.
    "bn.cu" BnSyncMoments<'a> ["bn_sync_moments"] {
        mean: In<'a, f32>,
        var: In<'a, f32>,
        rows: f64,
        channels: i32,
        sums: Out<'a, f64>,
    }
    /// Synchronised BN: the replicas' summed moments → statistics.
    "bn.cu" BnSyncStatistics<'a> ["bn_sync_statistics"] {
        sums: In<'a, f64>,
        channels: i32,
        momentum: f32,
        mean: Out<'a, f32>,
        var: Out<'a, f32>,
        running_mean: Out<'a, f32>,
        running_var: Out<'a, f32>,
    }
    /// Synchronised BN: this replica's dγ, dβ as shares of the sums.
    "bn.cu" BnSyncGradSums<'a> ["bn_sync_grad_sums"] {
        dgamma: In<'a, f32>,
        dbeta: In<'a, f32>,
        moments: In<'a, f64>,
        rows: f64,
        channels: i32,
        sums: Out<'a, f64>,
    }
    /// Synchronised BN: the summed gradient reductions rounded to f32.
    "bn.cu" BnSyncReductions<'a> ["bn_sync_reductions"] {
        sums: In<'a, f64>,
        channels: i32,
        dgamma: Out<'a, f32>,
        dbeta: Out<'a, f32>,
    }
    /// Per-slab Σdy and Σdy·x̂ (through the ReLU's mask when `relu` is 1).
    "bn.cu" BnBwdPartial<'a> ["bn_bwd_partial", "bn_bwd_partial_vec"] {
        dy: In<'a, u16>,
        y: In<'a, u16>,
        x: In<'a, u16>,
        mean: In<'a, f32>,
        invstd: In<'a, f32>,
        rows: i32,
        channels: i32,
        rows_per_slab: i32,
        relu: i32,
        part_dbeta: Out<'a, f32>,
        part_dgamma: Out<'a, f32>,
    }
    /// The slabs' sums merged into dβ and dγ.
    "bn.cu" BnBwdFinalize<'a> ["bn_bwd_finalize"] {
        part_dbeta: In<'a, f32>,
        part_dgamma: In<'a, f32>,
        slabs: i32,
        channels: i32,
        dbeta: Out<'a, f32>,
        dgamma: Out<'a, f32>,
    }
    /// dx (and the residual's gradient `dres`, when there is one).
    "bn.cu" BnBwdApply<'a> ["bn_bwd_apply", "bn_bwd_apply_vec"] {
        dy: In<'a, u16>,
        y: In<'a, u16>,
        x: In<'a, u16>,
        mean: In<'a, f32>,
        invstd: In<'a, f32>,
        gamma: In<'a, u16>,
        dbeta: In<'a, f32>,
        dgamma: In<'a, f32>,
        total: i64,
        channels: i32,
        relu: i32,
        batch_stats: i32,
        dx: Out<'a, u16>,
        dres: Option<Out<'a, u16>>,
        accumulate_res: i32,
    }
    /// Tile (mean, M2) records merged into moments (`out_count` null: a first-level group).
    "bn.cu" BnStatsMerge<'a> ["bn_stats_merge"] {
        part_mean: In<'a, f32>,
        part_m2: In<'a, f32>,
        records: i32,
        rows: i32,
        channels: i32,
        rows_per_record: i64,
        per_group: i32,
        out_mean: Out<'a, f32>,
        out_m2: Out<'a, f32>,
        out_count: Option<Out<'a, f32>>,
    }
    /// Moments → saved mean, 1/std and the running statistics.
    "bn.cu" BnMomentsFinalize<'a> ["bn_moments_finalize"] {
        moments: In<'a, f32>,
        channels: i32,
        eps: f32,
        momentum: f32,
        mean_out: Out<'a, f32>,
        invstd_out: Out<'a, f32>,
        running_mean: Out<'a, f32>,
        running_var: Out<'a, f32>,
    }
    /// Tile (Σg, Σg·x̂) records summed into dβ and dγ.
    "bn.cu" BnSumsMerge<'a> ["bn_sums_merge"] {
        part_b: In<'a, f32>,
        part_g: In<'a, f32>,
        records: i32,
        channels: i32,
        per_group: i32,
        out_b: Out<'a, f32>,
        out_g: Out<'a, f32>,
    }
    /// The fused dgrad epilogue's work on g, for a convolution no fused kernel takes.
    "bn.cu" BnGradFinish<'a> ["bn_grad_finish"] {
        g: Out<'a, u16>,
        residual: Option<In<'a, u16>>,
        y: Option<In<'a, u16>>,
        total: i64,
    }

    // pool.cu
    /// Max pool forward.
    "pool.cu" MaxpoolFwd<'a> ["maxpool_fwd", "maxpool_fwd_vec"] {
        x: In<'a, u16>,
        y: Out<'a, u16>,
        n: i32,
        h: i32,
        w: i32,
        c: i32,
        p: i32,
        q: i32,
        win: i32,
        stride: i32,
        pad: i32,
    }
    /// Max pool backward (gather).
    "pool.cu" MaxpoolBwd<'a> ["maxpool_bwd", "maxpool_bwd_vec"] {
        x: In<'a, u16>,
        dy: In<'a, u16>,
        dx: Out<'a, u16>,
        n: i32,
        h: i32,
        w: i32,
        c: i32,
        p: i32,
        q: i32,
        win: i32,
        stride: i32,
        pad: i32,
        accumulate: i32,
    }
    /// Max pool over a batch norm's output, applied as the pool reads its input `z`.
    "pool.cu" MaxpoolBnFwd<'a> ["maxpool_bn_fwd", "maxpool_bn_fwd_vec"] {
        z: In<'a, u16>,
        mean: In<'a, f32>,
        invstd: In<'a, f32>,
        gamma: In<'a, u16>,
        beta: In<'a, u16>,
        relu: i32,
        y: Out<'a, u16>,
        n: i32,
        h: i32,
        w: i32,
        c: i32,
        p: i32,
        q: i32,
        win: i32,
        stride: i32,
        pad: i32,
    }
    /// Its backward: the batch norm's finished incoming gradient `g` (masked, overwritten).
    "pool.cu" MaxpoolBnBwd<'a> ["maxpool_bn_bwd"] {
        z: In<'a, u16>,
        mean: In<'a, f32>,
        invstd: In<'a, f32>,
        gamma: In<'a, u16>,
        beta: In<'a, u16>,
        relu: i32,
        dy: In<'a, u16>,
        g: Out<'a, u16>,
        n: i32,
        h: i32,
        w: i32,
        c: i32,
        p: i32,
        q: i32,
        win: i32,
        stride: i32,
        pad: i32,
    }
    /// Its 16-byte backward, which also leaves each tile's Σg, Σg·x̂ (records `[tiles][c]`).
    "pool.cu" MaxpoolBnBwdVec<'a> ["maxpool_bn_bwd_vec"] {
        z: In<'a, u16>,
        mean: In<'a, f32>,
        invstd: In<'a, f32>,
        gamma: In<'a, u16>,
        beta: In<'a, u16>,
        relu: i32,
        dy: In<'a, u16>,
        g: Out<'a, u16>,
        n: i32,
        h: i32,
        w: i32,
        c: i32,
        p: i32,
        q: i32,
        win: i32,
        stride: i32,
        pad: i32,
        part_b: Out<'a, f32>,
        part_g: Out<'a, f32>,
    }
    /// Global average pool forward.
    "pool.cu" GapFwd<'a> ["gap_fwd"] {
        x: In<'a, u16>,
        y: Out<'a, u16>,
        n: i32,
        hw: i32,
        c: i32,
    }
    /// Global average pool backward.
    "pool.cu" GapBwd<'a> ["gap_bwd"] {
        dy: In<'a, u16>,
        dx: Out<'a, u16>,
        n: i32,
        hw: i32,
        c: i32,
        accumulate: i32,
    }

    // linear.cu
    /// y = x·wᵀ + b.
    "linear.cu" LinearFwd<'a> ["linear_fwd"] {
        x: In<'a, u16>,
        w: In<'a, u16>,
        b: In<'a, u16>,
        y: Out<'a, u16>,
        n: i32,
        inputs: i32,
        outputs: i32,
    }
    /// dx = dy·w (added with `accumulate`).
    "linear.cu" LinearBwdData<'a> ["linear_bwd_data"] {
        dy: In<'a, u16>,
        w: In<'a, u16>,
        dx: Out<'a, u16>,
        n: i32,
        inputs: i32,
        outputs: i32,
        accumulate: i32,
    }
    /// dw = dyᵀ·x.
    "linear.cu" LinearBwdWeight<'a> ["linear_bwd_weight"] {
        dy: In<'a, u16>,
        x: In<'a, u16>,
        dw: Out<'a, f32>,
        n: i32,
        inputs: i32,
        outputs: i32,
    }
    /// db = Σ dy over the rows.
    "linear.cu" LinearBiasGrad<'a> ["linear_bias_grad"] {
        dy: In<'a, u16>,
        db: Out<'a, f32>,
        n: i32,
        outputs: i32,
    }

    // loss.cu
    /// Softmax cross-entropy per row: loss, top-k rank, and (when not null) the logits'
    /// gradient and the probabilities.
    "loss.cu" SoftmaxXent<'a> ["softmax_xent"] {
        logits: In<'a, u16>,
        labels: In<'a, i32>,
        k: i32,
        smoothing: f32,
        own_weight: In<'a, f32>,
        grad_scale: f32,
        loss: Out<'a, f32>,
        rank: Out<'a, i32>,
        dlogits: Option<Out<'a, u16>>,
        probs: Option<Out<'a, f32>>,
    }
    /// The step's figures summed on the device (`loss` and `rank` null when `n` is 0).
    "loss.cu" LossTotals<'a> ["loss_totals"] {
        loss: Option<In<'a, f32>>,
        rank: Option<In<'a, i32>>,
        n: i32,
        stop: In<'a, i32>,
        add: i32,
        totals: Out<'a, f64>,
    }

    // optim.cu
    /// Σg² per chunk of the address table.
    "optim.cu" GradSumsq<'a> ["grad_sumsq"] {
        grad_ptr: In<'a, u64>,
        chunk_len: In<'a, i32>,
        partial: Out<'a, f64>,
    }
    /// The chunks' Σg² summed.
    "optim.cu" GradSumsqTotal<'a> ["grad_sumsq_total"] {
        partial: In<'a, f64>,
        n: i32,
        sumsq: Out<'a, f64>,
    }
    /// SGD over every parameter chunk, writing the bf16 working copies.
    "optim.cu" SgdUpdate<'a> ["sgd_update"] {
        master: Out<'a, f32>,
        buf: Out<'a, f32>,
        grad_ptr: In<'a, u64>,
        work_ptr: In<'a, u64>,
        chunk_start: In<'a, i64>,
        chunk_len: In<'a, i32>,
        chunk_wd: In<'a, f32>,
        lr: In<'a, f32>,
        momentum: f32,
        grad_scale: f32,
        nesterov: i32,
        max_norm: f32,
        sumsq: In<'a, f64>,
    }
    /// Adam / AdamW over every parameter chunk, writing the bf16 working copies.
    "optim.cu" AdamUpdate<'a> ["adam_update"] {
        master: Out<'a, f32>,
        m: Out<'a, f32>,
        v: Out<'a, f32>,
        grad_ptr: In<'a, u64>,
        work_ptr: In<'a, u64>,
        chunk_start: In<'a, i64>,
        chunk_len: In<'a, i32>,
        chunk_wd: In<'a, f32>,
        lr: In<'a, f32>,
        beta1: f32,
        beta2: f32,
        eps: f32,
        grad_scale: f32,
        bias_c: In<'a, f32>,
        decoupled: i32,
        max_norm: f32,
        sumsq: In<'a, f64>,
    }
    /// x *= alpha.
    "optim.cu" ScaleF32<'a> ["scale_f32"] {
        x: Out<'a, f32>,
        n: i64,
        alpha: f32,
    }
    /// A micro-batch's gradient into the accumulator (or the sum into the gradient).
    "optim.cu" GradAccumulate<'a> ["grad_accumulate"] {
        acc: Out<'a, f32>,
        g: Out<'a, f32>,
        n: i64,
        w: f32,
        mode: i32,
    }

    // collective.cu
    /// The ranks' f32 values averaged into every rank's buffer.
    "collective.cu" RankAverageF32 ["rank_average_f32"] {
        b: RankBuffersF32,
        ranks: i32,
        n: i64,
    }
    /// The ranks' f64 values summed into every rank's buffer.
    "collective.cu" RankSumF64 ["rank_sum_f64"] {
        b: RankBuffersF64,
        ranks: i32,
        n: i64,
    }
}

/// The guard the compiler cannot give: each launcher against the kernel source. NVRTC compiles
/// kernels/*.cu at run time, so nothing at build time sees a kernel's parameters; these tests
/// read them from the text (comments and preprocessor lines dropped, `__restrict__`,
/// `__launch_bounds__` and type spellings normalised) and compare every launcher with every
/// kernel it names: the count, the order, pointer or value, the element type, `const`, and the
/// size of each value (a struct's from its C declaration).
#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::*;
    use crate::cuda::launch::{ArgKind, Kernel, Signature};
    use crate::cuda::sources::KERNEL_FILES;

    /// A kernel parameter as kernels/*.cu declares it.
    #[derive(Debug, Clone, PartialEq)]
    enum CParam {
        /// A pointer to `elem` (canonical spelling), `const` unless `mutable`.
        Ptr { elem: String, mutable: bool },
        /// A value of type `ty` (canonical spelling, or a struct's name).
        Value { ty: String },
    }

    /// `text` with its comments blanked (string literals kept as they are).
    fn strip_comments(text: &str) -> String {
        let (b, mut out, mut i) = (text.as_bytes(), String::with_capacity(text.len()), 0);
        while i < b.len() {
            if b[i] == b'"' {
                let end = text[i + 1..].find('"').map_or(b.len(), |e| i + 2 + e);
                out.push_str(&text[i..end]);
                i = end;
            } else if text[i..].starts_with("//") {
                let end = text[i..].find('\n').map_or(b.len(), |e| i + e);
                i = end;
            } else if text[i..].starts_with("/*") {
                let end = text[i + 2..].find("*/").map_or(b.len(), |e| i + 4 + e);
                // Keep line breaks so that preprocessor lines stay lines.
                out.extend(text[i..end].chars().filter(|&c| c == '\n'));
                out.push(' ');
                i = end;
            } else {
                let ch = text[i..].chars().next().expect("in bounds");
                out.push(ch);
                i += ch.len_utf8();
            }
        }
        out
    }

    /// `text` without its preprocessor lines (with their continuations).
    fn without_preprocessor(text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut continued = false;
        for line in text.lines() {
            let directive = continued || line.trim_start().starts_with('#');
            continued = directive && line.trim_end().ends_with('\\');
            if !directive {
                out.push_str(line);
            }
            out.push('\n');
        }
        out
    }

    /// The index of the bracket closing the one at `open`.
    fn closing(text: &str, open: usize) -> Option<usize> {
        let mut depth = 0i32;
        for (i, ch) in text[open..].char_indices() {
            match ch {
                '(' | '[' | '{' => depth += 1,
                ')' | ']' | '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(open + i);
                    }
                }
                _ => {}
            }
        }
        None
    }

    /// `text` split on the commas outside any bracket.
    fn top_level(text: &str) -> Vec<&str> {
        let (mut depth, mut start, mut parts) = (0i32, 0, Vec::new());
        for (i, ch) in text.char_indices() {
            match ch {
                '(' | '[' | '{' | '<' => depth += 1,
                ')' | ']' | '}' | '>' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&text[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&text[start..]);
        parts.retain(|p| !p.trim().is_empty());
        parts
    }

    /// One spelling per type: the launchers name `bf16`, `u8`, `int`, `long`,
    /// `unsigned long long`, `float`, `double`.
    fn canonical(ty: &str) -> String {
        match ty {
            "__nv_bfloat16" | "nv_bfloat16" => "bf16",
            "unsigned char" | "uint8_t" => "u8",
            "signed" | "signed int" | "int32_t" => "int",
            "long int" | "long long" | "long long int" | "int64_t" => "long",
            "unsigned long" | "unsigned long int" | "unsigned long long int" | "uint64_t" => {
                "unsigned long long"
            }
            other => other,
        }
        .to_string()
    }

    fn is_identifier(word: &str) -> bool {
        word.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && word.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    }

    /// One parameter declaration (`const bf16* __restrict__ x`, `int n`, `Conv2Args args`).
    fn parse_param(decl: &str) -> Result<CParam, String> {
        let spaced = decl.replace('*', " * ").replace('&', " & ");
        let words: Vec<&str> = spaced
            .split_whitespace()
            .filter(|w| {
                !matches!(
                    *w,
                    "__restrict__" | "__restrict" | "restrict" | "__grid_constant__"
                )
            })
            .collect();
        let stars = words.iter().filter(|w| **w == "*").count();
        if stars > 1 || words.contains(&"&") || decl.contains('[') {
            return Err(format!(
                "`{decl}`: only T, T* and const T* parameters are checked"
            ));
        }
        let name = *words.last().ok_or_else(|| format!("`{decl}`: empty"))?;
        if !is_identifier(name) || matches!(name, "const" | "volatile") {
            return Err(format!("`{decl}`: no parameter name"));
        }
        let star = words.iter().position(|w| *w == "*");
        let before = &words[..star.unwrap_or(words.len() - 1)];
        let is_const = before.contains(&"const");
        let ty: Vec<&str> = before
            .iter()
            .copied()
            .filter(|w| !matches!(*w, "const" | "volatile"))
            .collect();
        if ty.is_empty() || !ty.iter().all(|w| is_identifier(w)) {
            return Err(format!("`{decl}`: no type"));
        }
        let ty = canonical(&ty.join(" "));
        Ok(match star {
            Some(_) => CParam::Ptr {
                elem: ty,
                mutable: !is_const,
            },
            None => CParam::Value { ty },
        })
    }

    /// `text` past its leading `__attribute__`-style words (`__launch_bounds__(256, 2)`,
    /// `__cluster_dims__(2, 1, 1)`, `__noinline__`), with their arguments.
    fn skip_attributes(mut text: &str) -> Result<&str, String> {
        loop {
            text = text.trim_start();
            let word_len = text
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(text.len());
            let word = &text[..word_len];
            if !(word.len() > 4 && word.starts_with("__") && word.ends_with("__")) {
                return Ok(text);
            }
            text = text[word_len..].trim_start();
            if text.starts_with('(') {
                let close = closing(text, 0).ok_or_else(|| format!("unbalanced {word}("))?;
                text = &text[close + 1..];
            }
        }
    }

    /// Every `extern "C" __global__` kernel of `text` and its parameters.
    fn kernel_signatures(text: &str) -> Result<BTreeMap<String, Vec<CParam>>, String> {
        let text = without_preprocessor(&strip_comments(text));
        let mut kernels = BTreeMap::new();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("extern \"C\"") {
            rest = rest[at + "extern \"C\"".len()..].trim_start();
            let Some(after) = rest.strip_prefix("__global__") else {
                continue; // a host or device function
            };
            let after = skip_attributes(after)?;
            let after = after
                .strip_prefix("void")
                .ok_or_else(|| format!("a kernel that does not return void: {:.60}", after))?;
            let after = skip_attributes(after)?;
            let name_len = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            let (name, after) = after.split_at(name_len);
            let after = after.trim_start();
            if !is_identifier(name) || !after.starts_with('(') {
                return Err(format!("cannot read the kernel declared at: {:.80}", after));
            }
            let close = closing(after, 0).ok_or_else(|| format!("{name}: unbalanced ("))?;
            let list = after[1..close].trim();
            let params = if list.is_empty() || list == "void" {
                Vec::new()
            } else {
                top_level(list)
                    .into_iter()
                    .map(parse_param)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| format!("{name}: {e}"))?
            };
            if kernels.insert(name.to_string(), params).is_some() {
                return Err(format!("{name} is defined twice"));
            }
            rest = &after[close..];
        }
        Ok(kernels)
    }

    /// The value of `#define name VALUE` in `text`, when VALUE is a number.
    fn define(text: &str, name: &str) -> Option<usize> {
        text.lines().find_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("#define") && words.next() == Some(name))
                .then(|| words.next()?.parse().ok())
                .flatten()
        })
    }

    /// Size and alignment of a scalar or pointer field.
    fn scalar_size(ty: &str) -> Option<usize> {
        match ty {
            "int" | "float" | "unsigned" | "unsigned int" => Some(4),
            "long" | "double" | "unsigned long long" => Some(8),
            "bf16" | "u16" => Some(2),
            "u8" => Some(1),
            _ => None,
        }
    }

    /// The size of C type `ty` as a kernel parameter in `text`: a scalar's, or a struct's from
    /// its fields (scalars, pointers and arrays of them, with C's alignment).
    fn c_size(text: &str, ty: &str) -> Result<usize, String> {
        if let Some(size) = scalar_size(ty) {
            return Ok(size);
        }
        if ty == "CUtensorMap" {
            return Ok(128); // the driver's opaque TMA descriptor (cuda.h)
        }
        let code = without_preprocessor(&strip_comments(text));
        let head = format!("struct {ty}");
        let at = code
            .match_indices(&head)
            .map(|(at, _)| at + head.len())
            .find(|&at| code[at..].trim_start().starts_with('{'))
            .ok_or_else(|| format!("struct {ty} is not declared in the file"))?;
        let open = at + code[at..].find('{').expect("found above");
        let close = closing(&code, open).ok_or_else(|| format!("struct {ty}: unbalanced {{"))?;
        let (mut offset, mut align_max) = (0usize, 1usize);
        for field in code[open + 1..close]
            .split(';')
            .filter(|f| !f.trim().is_empty())
        {
            let mut pieces = top_level(field).into_iter();
            let first = pieces.next().expect("not empty").replace('*', " * ");
            let mut words: Vec<&str> = first.split_whitespace().collect();
            let first_declarator = words.pop().ok_or_else(|| format!("{ty}: `{field}`"))?;
            let base_ptr = words.last() == Some(&"*");
            let base: Vec<&str> = words
                .iter()
                .copied()
                .filter(|w| !matches!(*w, "*" | "const" | "volatile"))
                .collect();
            let base = canonical(&base.join(" "));
            let declarators =
                std::iter::once((first_declarator.to_string(), base_ptr)).chain(pieces.map(|p| {
                    let p = p.trim();
                    (
                        p.trim_start_matches('*').trim().to_string(),
                        p.starts_with('*'),
                    )
                }));
            for (declarator, ptr) in declarators {
                let elem = if ptr {
                    8
                } else {
                    scalar_size(&base).ok_or_else(|| format!("{ty}: field type `{base}`"))?
                };
                let count = match declarator.split_once('[') {
                    None => 1,
                    Some((_, dim)) => {
                        let dim = dim.trim_end_matches(']').trim();
                        dim.parse()
                            .ok()
                            .or_else(|| define(text, dim))
                            .ok_or_else(|| format!("{ty}: array size `{dim}`"))?
                    }
                };
                offset = offset.div_ceil(elem) * elem + elem * count;
                align_max = align_max.max(elem);
            }
        }
        Ok(offset.div_ceil(align_max) * align_max)
    }

    /// What `sig` gets wrong about its kernels in `text` (the file it names): one line each.
    fn mismatches(sig: &Signature, text: &str) -> Vec<String> {
        let kernels = match kernel_signatures(text) {
            Ok(k) => k,
            Err(e) => return vec![format!("{}: {e}", sig.file)],
        };
        let mut wrong = Vec::new();
        for name in sig.names {
            let at = format!("{} launches {}/{name}", sig.launcher, sig.file);
            let Some(params) = kernels.get(*name) else {
                wrong.push(format!("{at}: no such kernel"));
                continue;
            };
            if params.len() != sig.params.len() {
                wrong.push(format!(
                    "{at}: {} arguments, the kernel takes {}",
                    sig.params.len(),
                    params.len()
                ));
            }
            for (i, ((field, rust), c)) in sig.params.iter().zip(params).enumerate() {
                let matches = match (rust, c) {
                    (
                        ArgKind::Ptr { elem, mutable },
                        CParam::Ptr {
                            elem: ce,
                            mutable: cm,
                        },
                    ) => elem == ce && mutable == cm,
                    (ArgKind::Value { ty, size }, CParam::Value { ty: ct }) => {
                        ty == ct && c_size(text, ct).is_ok_and(|s| s == *size)
                    }
                    _ => false,
                };
                if !matches {
                    let size = match c {
                        CParam::Value { ty } => format!(" ({:?} bytes)", c_size(text, ty)),
                        CParam::Ptr { .. } => String::new(),
                    };
                    wrong.push(format!(
                        "{at}: argument {i} `{field}` is {rust:?}, the kernel's is {c:?}{size}"
                    ));
                }
            }
        }
        wrong
    }

    fn file_text(name: &str) -> &'static str {
        KERNEL_FILES
            .iter()
            .find(|f| f.name == name)
            .unwrap_or_else(|| panic!("{name} is not in KERNEL_FILES"))
            .text
    }

    #[test]
    fn every_launcher_matches_the_kernels_it_names() {
        let wrong: Vec<String> = LAUNCHERS
            .iter()
            .flat_map(|sig| mismatches(sig, file_text(sig.file)))
            .collect();
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        let kernels: usize = LAUNCHERS.iter().map(|s| s.names.len()).sum();
        assert!(kernels >= 70, "only {kernels} kernels have launchers");
    }

    #[test]
    fn every_kernel_file_parses() {
        for file in KERNEL_FILES {
            let kernels =
                kernel_signatures(file.text).unwrap_or_else(|e| panic!("{}: {e}", file.name));
            // The parser sees every kernel the name scan of sources.rs sees.
            let names: Vec<String> = kernels.keys().cloned().collect();
            let mut listed = file.kernel_names();
            listed.sort();
            assert_eq!(names, listed, "{}", file.name);
        }
    }

    /// The check is known to catch what it is for: each kind of mistake, on a real kernel
    /// whose declaration is altered one way at a time, and on a launcher's own list.
    #[test]
    fn a_mismatched_signature_fails_the_check() {
        let bn = file_text("bn.cu");
        let sig = LAUNCHERS.iter().find(|s| s.launcher == "BnApply").unwrap();
        assert!(mismatches(sig, bn).is_empty());
        let declaration = "long total, int channels, int relu)";
        assert_eq!(
            bn.matches(declaration).count(),
            2,
            "bn_apply and bn_apply_vec"
        );
        for (what, altered) in [
            ("a value's type", "int total, int channels, int relu)"),
            ("the order", "int channels, long total, int relu)"),
            ("a missing parameter", "long total, int channels)"),
            (
                "an extra parameter",
                "long total, int channels, int relu, int extra)",
            ),
            (
                "a value for a pointer",
                "long* total, int channels, int relu)",
            ),
        ] {
            // The first declaration is bn_apply's: bn_apply_vec still matches.
            let wrong = mismatches(sig, &bn.replacen(declaration, altered, 1));
            let only_bn_apply = wrong.iter().all(|w| w.contains("bn.cu/bn_apply:"));
            assert!(!wrong.is_empty() && only_bn_apply, "{what}: {wrong:?}");
        }
        let residual = "const bf16* __restrict__ residual,\n                                    bf16* __restrict__ y,";
        assert!(bn.contains(residual));
        for (what, altered) in [
            (
                "const",
                "bf16* __restrict__ residual, bf16* __restrict__ y,",
            ),
            (
                "an element type",
                "const float* __restrict__ residual, bf16* __restrict__ y,",
            ),
            (
                "a written pointer",
                "const bf16* __restrict__ residual, const bf16* y,",
            ),
        ] {
            let wrong = mismatches(sig, &bn.replacen(residual, altered, 1));
            assert_eq!(wrong.len(), 1, "{what}: {wrong:?}");
            assert!(wrong[0].contains("bn.cu/bn_apply:"), "{what}: {wrong:?}");
        }
        // A struct passed by value whose C declaration gained a field.
        let conv = file_text("conv.cu");
        let gemm = LAUNCHERS.iter().find(|s| s.launcher == "ConvGemm").unwrap();
        assert!(mismatches(gemm, conv).is_empty());
        assert!(conv.contains("int accumulate;"));
        let grown = conv.replacen("int accumulate;", "int accumulate;\n    int extra;", 1);
        assert_eq!(mismatches(gemm, &grown).len(), gemm.names.len());
        // A launcher naming a kernel the file lacks.
        let renamed = bn.replace("bn_apply_vec(", "bn_apply_v(");
        assert_eq!(mismatches(sig, &renamed).len(), 1);
    }

    #[test]
    fn the_parser_reads_what_the_kernel_files_may_write() {
        let text = "#define DECL(n) extern \"C\" __global__ void n(int a)\n\
                    // extern \"C\" __global__ void commented(int a);\n\
                    extern \"C\" __device__ float helper(float x);\n\
                    extern \"C\" __global__ void __launch_bounds__(T::THREADS, 2)\n\
                    k(const __nv_bfloat16 * __restrict__ x, /* a note, with a comma */\n\
                      unsigned long long* p, long long n, Conv2Args args) {}\n\
                    extern \"C\" __global__ void __cluster_dims__(2, 1, 1)\n\
                    __launch_bounds__(384, 1) tma(const __grid_constant__ CUtensorMap map) {}";
        let kernels = kernel_signatures(text).unwrap();
        assert_eq!(kernels.keys().collect::<Vec<_>>(), ["k", "tma"]);
        let ptr = |elem: &str, mutable| CParam::Ptr {
            elem: elem.into(),
            mutable,
        };
        let value = |ty: &str| CParam::Value { ty: ty.into() };
        assert_eq!(
            kernels["k"],
            [
                ptr("bf16", false),
                ptr("unsigned long long", true),
                value("long"),
                value("Conv2Args")
            ]
        );
        assert_eq!(kernels["tma"], [value("CUtensorMap")]);
        assert_eq!(c_size(text, "CUtensorMap"), Ok(128));
        for bad in ["float** p", "int& r", "float x[4]", "const float*", "int"] {
            assert!(parse_param(bad).is_err(), "{bad}");
        }
        let structs = "#define N 8\nstruct S { double* ptr[N]; float scale[N]; };\n\
                       struct T { int a, b; float c; };";
        assert_eq!(c_size(structs, "S"), Ok(96));
        assert_eq!(c_size(structs, "T"), Ok(12));
    }

    /// Every file under `dir` ending in `.rs`.
    fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    #[test]
    fn kernels_are_launched_only_through_launchers() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = Vec::new();
        rust_files(&root.join("src"), &mut files);
        // Built here so that this file does not name them itself.
        let raw = [
            ["launch", "_builder("].concat(),
            ["launch", "_kernel("].concat(),
            ["cuLaunch", "Kernel"].concat(),
        ];
        let allowed = root.join("src/cuda/launch.rs");
        let mut offenders = Vec::new();
        for path in files.iter().filter(|p| **p != allowed) {
            let text = std::fs::read_to_string(path).unwrap();
            for needle in &raw {
                if text.contains(needle.as_str()) {
                    offenders.push(format!("{} calls {needle}", path.display()));
                }
            }
        }
        assert!(files.len() > 100, "found only {} sources", files.len());
        assert!(offenders.is_empty(), "{}", offenders.join("\n"));
    }

    #[test]
    fn every_kernel_named_in_the_cuda_sources_has_a_launcher() {
        let declared: Vec<&str> = LAUNCHERS.iter().flat_map(|s| s.names).copied().collect();
        let kernels: Vec<String> = KERNEL_FILES.iter().flat_map(|f| f.kernel_names()).collect();
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = Vec::new();
        rust_files(&root.join("src/cuda"), &mut files);
        let mut missing = Vec::new();
        for path in &files {
            let text = std::fs::read_to_string(path).unwrap();
            for literal in text.split('"').skip(1).step_by(2) {
                if kernels.iter().any(|k| k == literal) && !declared.contains(&literal) {
                    missing.push(format!("{}: {literal}", path.display()));
                }
            }
        }
        assert!(missing.is_empty(), "no launcher for {missing:?}");
    }

    #[test]
    fn the_v2_planner_names_only_kernels_of_the_launchers_the_backend_uses() {
        use crate::cuda::conv::{V2_APPLY_KERNELS, V2_BN_EPILOGUE_KERNELS, V2_GEMM_KERNELS};
        for name in V2_GEMM_KERNELS {
            let launcher = if name.starts_with("conv2_wgrad") {
                Conv2Wgrad::NAMES
            } else {
                Conv2Gemm::NAMES
            };
            assert!(launcher.contains(name), "{name}");
        }
        for name in V2_BN_EPILOGUE_KERNELS {
            let launcher = if name.starts_with("conv2_fwd_stats") {
                Conv2FwdStats::NAMES
            } else {
                Conv2DgradBn::NAMES
            };
            assert!(launcher.contains(name), "{name}");
        }
        for name in V2_APPLY_KERNELS {
            let launcher = if name.starts_with("conv2_fwd_stats_apply") {
                Conv2FwdStatsApply::NAMES
            } else if name.starts_with("conv2_fwd_apply") {
                Conv2FwdApply::NAMES
            } else {
                Conv2WgradApply::NAMES
            };
            assert!(launcher.contains(name), "{name}");
        }
    }
}
