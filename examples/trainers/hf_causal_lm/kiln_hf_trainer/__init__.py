"""kiln's worked example of a trainer of your own: a Hugging Face ``transformers`` causal LM
(``LlamaForCausalLM``, built from the recipe's ``[model]`` table) trained through kiln's trainer SDK.

Entry points a recipe names (``[trainer]``)::

    train    = "kiln_hf_trainer.train:main"                    # every rank, under torchrun (kiln's launchers)
    evaluate = "kiln_hf_trainer.evaluate:load_for_evaluation"   # a checkpoint as logits, for kiln's evaluation
    export   = "kiln_hf_trainer.export:main"                    # a checkpoint as a Hugging Face folder (registered)

Distribution ``kiln-example-hf-trainer``; it depends on ``kiln-trainer`` (the SDK and the contract).
"""
