"""Fine-tune a Hugging Face model folder with `transformers.Trainer` and a DeepSpeed JSON config
on CPU, in one process, as tests/test_hf_trainer.py runs it:

    python tests/hf_trainer_run.py HF_DIR BATCH.pt DEEPSPEED.json OUT_DIR STEPS

BATCH.pt holds `input_ids` [n, s]; each sample is its own labels (the standard causal-LM format:
the model shifts them). Micro-batch 2, gradient accumulation n / 2: every optimizer step is one
pass over the batch. The launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) come from the
caller. Prints, as its last line, one JSON object: the logged `losses`, the DeepSpeed engine's
`zero_stage` and `optimizer` class, and whether the weights changed.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from pretrain.training.backends.deepspeed.comm import disable_deepspeed_shm_allreduce


def main(hf_dir: str, batch_file: str, ds_config: str, out_dir: str, steps: str) -> None:
    # DeepSpeed's CPU backend JIT-builds an all-reduce op on first use (~40 s, docs/TRAINING.md);
    # one process never reduces anything across ranks
    disable_deepspeed_shm_allreduce()
    input_ids = torch.load(batch_file)["input_ids"]
    samples = [{"input_ids": ids, "labels": ids} for ids in input_ids]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    before = model.get_input_embeddings().weight.detach().clone()
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=len(samples) // 2,
        max_steps=int(steps),
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        deepspeed=ds_config,
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=samples)
    trainer.train()
    engine = trainer.model_wrapped
    after = model.get_input_embeddings().weight.detach()
    print(json.dumps({
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "zero_stage": engine.zero_optimization_stage(),
        "optimizer": type(engine.optimizer).__name__,
        "weights_changed": not torch.equal(before, after),
    }))  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
