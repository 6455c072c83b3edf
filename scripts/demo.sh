#!/usr/bin/env bash
# make demo: SFT -> DPO -> evaluation of the tiny model on the shipped sample data, on CPU.
set -euo pipefail
PY=${PY:-.venv/bin/python}
DEMO=${DEMO_DIR:-outputs/demo/$(date +%Y-%m-%d_%H-%M-%S)}
COMMON=(trainer.enable_progress_bar=false)

echo "== 1/3 SFT: tiny Llama-architecture model, sample conversations ($DEMO/sft)"
$PY train.py "${COMMON[@]}" task_name=demo_sft trainer.max_epochs=6 hydra.run.dir="$DEMO/sft"
$PY scripts/loss_summary.py "$DEMO/sft" train/loss

echo "== 2/3 DPO on the SFT export, frozen reference copy ($DEMO/dpo)"
$PY train.py "${COMMON[@]}" task_name=demo_dpo objective=dpo model.path="$DEMO/sft/export" \
    optim.lr=1e-3 trainer.max_epochs=2 data.max_length=512 data.max_prompt_length=384 hydra.run.dir="$DEMO/dpo"
$PY scripts/loss_summary.py "$DEMO/dpo" train/loss train/rewards/accuracies train/rewards/margins

if [ -f evaluate.py ]; then
  echo "== 3/3 evaluation of the DPO export (local hf judge: verdicts meaningless, mechanics real)"
  # BERTScore with the offline MiniLM (the default, roberta-large as the paper, needs the model hub)
  $PY evaluate.py model.path="$DEMO/dpo/export" judge=hf generation.max_new_tokens=48 generation.cpu_threads=1 \
      metrics.bertscore.model=minilm \
      generation.progress=false hydra.run.dir="$DEMO/eval"   # prints "evaluation summary: <its path>"
fi
echo
echo "SFT export: $DEMO/sft/export"
echo "DPO export: $DEMO/dpo/export"
