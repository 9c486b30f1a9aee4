"""etp's data room: megatron-core's datasets and tokenizers wired to recipes, and preprocessing.

* ``etp.data.batch``: ``Batch`` (tokens, labels, loss mask, attention mask, position ids) and the
  per-document attention mask ([Note: per-document masks]).
* ``etp.data.tokenizer``: Megatron-LM tokenizer types through ``megatron.core.tokenizers``, local
  files only.
* ``etp.data.datasets``: a recipe's ``GPTDatasetConfig``, its train / valid / test datasets
  (``BlendedMegatronDatasetBuilder``: blends, splits, memory-mapped ``.bin`` / ``.idx``) and
  Megatron-LM's pretraining sampler over data-parallel ranks.
* ``etp.data.checks``: every data input error of a recipe, found before any rank starts.
* ``etp.data.preprocess``: JSONL to ``.bin`` / ``.idx`` (the ``etp-preprocess`` command's library).
* ``etp.data.tiny``: the bundled tiny dataset and tokenizer of the CPU quick start.

``import etp`` loads none of it; the modules import megatron-core when called.
"""
