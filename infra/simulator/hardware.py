"""The accelerators the simulator knows: datasheet peaks per GPU, and how GPUs are wired.

Sources (dense figures, no sparsity): NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOP/s
BF16, 1,979 FP8, 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s); NVIDIA H200 datasheet (same compute,
4.8 TB/s HBM3e, 141 GB); NVIDIA GB200 NVL72 and GB300 NVL72 product pages and the Blackwell
Ultra technical brief (per GPU: 2.5 PFLOP/s BF16, 5 FP8, 10 (GB200) / 15 (GB300) FP4 dense;
8 TB/s HBM3e; 186 / 288 GB; NVLink 5 at 1.8 TB/s; 72 GPUs in one NVLink domain). NVLink figures
are bidirectional: one direction of an all-to-all gets half. H100/H200 nodes are 8 GPUs on
NVLink with one 400 Gb/s InfiniBand NIC per GPU between nodes; GB200 has a 400 Gb/s and GB300 an
800 Gb/s (ConnectX-8) NIC per GPU between NVL72 racks.

Only the H100 is measured (loadtest/results/kernels.json): calibration.py fits the fraction of
these peaks Ferry's kernels reach there, and the same fractions are applied to every chip.
"""

from __future__ import annotations

from dataclasses import dataclass

TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float
    fp4_flops: float  # 0: no FP4 tensor cores (FP4 weights run at the FP8 rate)
    hbm_bytes_s: float
    hbm_bytes: float
    nvlink_bytes_s: float  # per GPU, both directions together (datasheet figure)
    nvlink_domain: int  # GPUs that reach each other over NVLink
    scale_out_bytes_s: float  # per GPU, one direction, between NVLink domains

    @property
    def nvlink_one_way(self) -> float:
        return self.nvlink_bytes_s / 2

    def all_to_all_bytes_s(self, group_size: int) -> float:
        """One direction of a GPU's all-to-all bandwidth in a group of ``group_size`` ranks: the
        share of its peers outside its NVLink domain go over the scale-out network, and the
        slower path sets the pace."""
        if group_size <= self.nvlink_domain:
            return self.nvlink_one_way
        outside = 1 - (self.nvlink_domain - 1) / (group_size - 1)
        return min(self.nvlink_one_way, self.scale_out_bytes_s / outside)


_IB_400G = 400e9 / 8  # one 400 Gb/s NIC per GPU

HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", 989 * TB, 1979 * TB, 0.0, 3.35 * TB, 80 * GB, 900 * GB, 8, _IB_400G),
    "h200": Hardware("h200", 989 * TB, 1979 * TB, 0.0, 4.8 * TB, 141 * GB, 900 * GB, 8, _IB_400G),
    "gb200": Hardware(
        "gb200", 2500 * TB, 5000 * TB, 10000 * TB, 8 * TB, 186 * GB, 1800 * GB, 72, _IB_400G
    ),
    "gb300": Hardware(
        "gb300", 2500 * TB, 5000 * TB, 15000 * TB, 8 * TB, 288 * GB, 1800 * GB, 72, _IB_400G * 2
    ),
}


def get_hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE)}")
    return HARDWARE[name]
