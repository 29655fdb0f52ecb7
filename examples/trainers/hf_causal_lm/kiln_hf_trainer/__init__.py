"""kiln's worked example of a trainer of your own: a Hugging Face ``transformers`` causal LM
(``LlamaForCausalLM``, built from the recipe's ``[model]`` table) trained through kiln's trainer SDK.

Entry points a recipe names (``[trainer]``)::

    train  = "kiln_hf_trainer.train:main"     # every rank, under torchrun (kiln's launchers)
    export = "kiln_hf_trainer.export:main"    # a committed checkpoint as a Hugging Face folder

Distribution ``kiln-example-hf-trainer``; it depends on ``kiln-trainer`` (the SDK and the contract).
"""
