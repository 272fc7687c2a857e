//! The kernel sources of kernels/, embedded in the binary at build time.
//!
//! Each file is one NVRTC translation unit; `#include "common.cuh"` is expanded here (textually)
//! so our own header needs no include path at run time.

/// The shared header every kernel file includes.
const COMMON: &str = include_str!("../../kernels/common.cuh");

use super::GpuArch;

/// The line a kernel file uses to pull in [`COMMON`].
const COMMON_INCLUDE: &str = "#include \"common.cuh\"";

/// One kernel file of kernels/.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelFile {
    /// The file name, e.g. `conv.cu`.
    pub name: &'static str,
    /// The file's text as written (before the header is expanded).
    pub text: &'static str,
}

/// Every kernel file, in the order `kernels check` reports them.
pub const KERNEL_FILES: &[KernelFile] = &[
    KernelFile {
        name: "input.cu",
        text: include_str!("../../kernels/input.cu"),
    },
    KernelFile {
        name: "conv.cu",
        text: include_str!("../../kernels/conv.cu"),
    },
    KernelFile {
        name: "conv2.cu",
        text: include_str!("../../kernels/conv2.cu"),
    },
    KernelFile {
        name: "conv3.cu",
        text: include_str!("../../kernels/conv3.cu"),
    },
    KernelFile {
        name: "bn.cu",
        text: include_str!("../../kernels/bn.cu"),
    },
    KernelFile {
        name: "pool.cu",
        text: include_str!("../../kernels/pool.cu"),
    },
    KernelFile {
        name: "linear.cu",
        text: include_str!("../../kernels/linear.cu"),
    },
    KernelFile {
        name: "loss.cu",
        text: include_str!("../../kernels/loss.cu"),
    },
    KernelFile {
        name: "optim.cu",
        text: include_str!("../../kernels/optim.cu"),
    },
    KernelFile {
        name: "collective.cu",
        text: include_str!("../../kernels/collective.cu"),
    },
];

/// The files whose kernels use Hopper's architecture-specific instructions (`wgmma`, TMA):
/// compiled for `sm_90a` on compute capability 9.0.
pub const HOPPER_FILES: &[&str] = &["conv3.cu"];

impl KernelFile {
    /// Looks a kernel file up by name (`conv.cu`).
    pub fn by_name(name: &str) -> Option<KernelFile> {
        KERNEL_FILES.iter().copied().find(|f| f.name == name)
    }

    /// The translation unit handed to NVRTC: the text with common.cuh expanded.
    pub fn expanded(&self) -> String {
        expand_common(self.text)
    }

    /// The target a device of architecture `device` compiles this file for: Hopper's own
    /// `sm_90a` for the files with `wgmma` kernels ([`HOPPER_FILES`]) on compute capability
    /// 9.0, the device's portable target otherwise (where those files' kernels are stubs).
    pub fn target_for(&self, device: GpuArch) -> GpuArch {
        if HOPPER_FILES.contains(&self.name) && (device.major, device.minor) == (9, 0) {
            GpuArch::specific(9, 0)
        } else {
            device
        }
    }

    /// The names of the `extern "C" __global__` kernels the file defines, in source order.
    pub fn kernel_names(&self) -> Vec<String> {
        kernel_names(self.text)
    }
}

/// Replaces the `#include "common.cuh"` line of `text` with the header itself.
pub fn expand_common(text: &str) -> String {
    text.replacen(COMMON_INCLUDE, COMMON, 1)
}

/// The names of the `extern "C" __global__` functions in `text`: the word before the first
/// `(` after the declaration (launch bounds and return type may sit in between).
pub fn kernel_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    const MARK: &str = "extern \"C\" __global__";
    while let Some(at) = rest.find(MARK) {
        rest = &rest[at + MARK.len()..];
        let Some(paren) = rest.find('(') else { break };
        let head = &rest[..paren];
        // `__launch_bounds__(...)` has its own parenthesis: skip past it.
        let (head, skip) = if head.trim_end().ends_with("__launch_bounds__") {
            let close = rest[paren..]
                .find(')')
                .map_or(rest.len(), |c| paren + c + 1);
            let after = &rest[close..];
            let next = after.find('(').map_or(after.len(), |p| p);
            (&after[..next], close + next)
        } else {
            (head, paren)
        };
        if let Some(name) = head.split_whitespace().last() {
            names.push(name.trim_start_matches('*').to_string());
        }
        rest = &rest[skip..];
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hopper_files_compile_for_sm_90a_on_hopper_only() {
        let conv3 = KernelFile::by_name("conv3.cu").unwrap();
        let conv2 = KernelFile::by_name("conv2.cu").unwrap();
        assert_eq!(
            conv3.target_for(GpuArch::new(9, 0)),
            GpuArch::specific(9, 0)
        );
        assert_eq!(conv2.target_for(GpuArch::new(9, 0)), GpuArch::new(9, 0));
        assert_eq!(conv3.target_for(GpuArch::new(8, 0)), GpuArch::new(8, 0));
        assert_eq!(conv3.target_for(GpuArch::new(10, 0)), GpuArch::new(10, 0));
    }

    #[test]
    fn every_file_exposes_its_kernels() {
        let conv = KernelFile::by_name("conv.cu").unwrap();
        assert_eq!(
            conv.kernel_names(),
            [
                "conv_fwd_vec",
                "conv_fwd_scalar",
                "conv_dgrad_vec",
                "conv_dgrad_scalar",
                "conv_wgrad_vec",
                "conv_wgrad_stem",
                "conv_wgrad_scalar"
            ]
        );
        let bn = KernelFile::by_name("bn.cu").unwrap();
        assert!(bn.kernel_names().contains(&"bn_bwd_apply".to_string()));
        for file in KERNEL_FILES {
            assert!(
                !file.kernel_names().is_empty(),
                "{} defines no kernel",
                file.name
            );
        }
    }

    #[test]
    fn common_header_is_expanded_once() {
        let text = KernelFile::by_name("pool.cu").unwrap().expanded();
        assert!(!text.contains(COMMON_INCLUDE));
        assert!(text.contains("bt_block_sum"));
    }

    #[test]
    fn every_file_opens_with_its_design_comment() {
        for file in KERNEL_FILES {
            for part in ["Algorithm", "Data layout", "Launch configuration"] {
                assert!(
                    file.text.contains(part),
                    "{} lacks its {part} paragraph",
                    file.name
                );
            }
        }
    }
}
