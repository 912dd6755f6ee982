"""megatron-mis: training-inference mismatch correction for Megatron-Core RL."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
version = {}
exec((HERE / "megatron_mis" / "_version.py").read_text(), version)

setup(
    name="megatron-mis",
    version=version["__version__"],
    description=(
        "Masked / truncated importance sampling, rejection sampling, routing replay and "
        "mismatch monitoring for Megatron-Core based LLM reinforcement learning"
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The top-level configs/ folder (documented mis.yaml and the presets) is installed as
    # megatron_mis/_configs so that `--correction PRESET` works from a wheel, too.
    packages=find_packages(include=["megatron_mis", "megatron_mis.*"]) + ["megatron_mis._configs"],
    package_dir={"megatron_mis._configs": "configs"},
    package_data={
        "megatron_mis": ["py.typed"],
        "megatron_mis._configs": ["*.yaml", "presets/*.yaml"],
    },
    install_requires=[
        # torch is deliberately unpinned here: install the wheel for your platform first
        # (on CPU machines `pip install torch==2.13.0`, see README).
        "torch>=2.1",
        "megatron-core>=0.13",
        "pyyaml>=6.0",
        "numpy",  # routing/sglang.py decodes routes with it; megatron-core requires it anyway
    ],
    extras_require={
        # Only the CPU testbed and the command line's demo / study / analyze use these (plots and
        # progress bars); the drop-ins a training container imports never do
        # (tests/unit/test_install_light.py). The command line names this extra when one is missing.
        "demo": ["matplotlib>=3.7", "tqdm>=4.60"],
        "test": ["pytest>=7.4", "hypothesis>=6.80"],
        # CUDA only; never needed (nor imported at top level) on CPU.
        "gpu": ["transformer-engine[pytorch]>=1.9"],
        "rollout": ["sglang>=0.4.6"],
        "tensorboard": ["tensorboard>=2.12"],
        "wandb": ["wandb>=0.16"],
    },
    entry_points={"console_scripts": ["megatron-mis=megatron_mis.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
