"""Packaging for etp: Extended Tensor Parallelism for megatron-core MoE training."""
from setuptools import find_packages, setup

setup(
    name="etp",
    version="0.1.0",
    description="Extended Tensor Parallelism (ZeRO-3 along a model-parallel axis) for megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["etp", "etp.*"]),
    # The CPU quick start's corpus, its indexed dataset and tokenizer (etp/data/tiny.py).
    package_data={"etp.data": ["*.txt", "*.bin", "*.idx", "tiny_tokenizer/*.json"]},
    entry_points={"console_scripts": ["etp-train = etp.train.main:main", "etp-audit = etp.train.audit_command:main",
                                      "etp-preprocess = etp.train.preprocess_command:main",
                                      "etp-convert = etp.train.convert_command:main"]},
    install_requires=[
        # torch 2.11 (the GPU machines) through 2.13 (CPU machines) are tested.
        "torch>=2.11",
        # The range etp.megatron.patches supports (checked at import), tested on 0.16.1 and 0.19.2
        # (0.17 and later need Python 3.12); imported lazily by etp.megatron only.
        "megatron-core>=0.16.1,<0.20",
        "triton",
        "pyyaml",
    ],
    # "metrics": etp-train's tensorboard_dir / wandb_project (etp.train.metrics); "jax": etp.jax (expert
    # parallelism for JAX under shard_map); "data": Hugging Face tokenizers through megatron-core
    # (transformers) and training small ones locally (tokenizers), etp.data: the CPU quick start's
    # tokenizer is one; "hf": transformers and safetensors, for Hugging Face checkpoints (etp-convert,
    # docs/hf.md) and the tests that check conversions against transformers' own models (etp.hf reads
    # and writes safetensors itself). Nothing imports them unless a run asks.
    extras_require={"test": ["pytest", "matplotlib", "ruff", "tensorboard", "transformers>=5.24,<6", "tokenizers",
                             "safetensors>=0.8"],
                    "audit": ["matplotlib"], "jax": ["jax"], "data": ["transformers>=5.24,<6", "tokenizers"],
                    "metrics": ["tensorboard", "wandb"], "hf": ["transformers>=5.24,<6", "safetensors>=0.8"]},
)
