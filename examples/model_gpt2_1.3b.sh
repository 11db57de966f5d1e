# Shared flags for the launch recipes in this folder: a GPT-2-style 1.3B model, bf16, ZeRO-1.
# Source it, then pass "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}" to pretrain_gpt.py.
# Every size comes from the environment when set, so one recipe serves a laptop and 64 nodes:
#   DATA_PREFIX, VOCAB, MERGES, SAVE_DIR                       data and checkpoint paths
#   NUM_LAYERS, HIDDEN_SIZE, NUM_ATTENTION_HEADS, SEQ_LENGTH   the model
#   MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS            the schedule
#   SAVE_INTERVAL, LOG_INTERVAL, EVAL_INTERVAL, EVAL_ITERS
#   PRECISION (bf16, fp16 or fp32), ZERO_STAGE
#   TOKENIZER_FLAGS  replaces the GPT-2 BPE tokenizer flags (e.g. "--tokenizer-type NullTokenizer
#                    --vocab-size 100"); EXTRA_ARGS  appended last (argparse: the last value wins)
DATA_PREFIX=${DATA_PREFIX:-/data/corpus_text_document}
VOCAB=${VOCAB:-/data/gpt2/vocab.json}
MERGES=${MERGES:-/data/gpt2/merges.txt}
SAVE_DIR=${SAVE_DIR:-/checkpoints/gpt2-1.3b}
SEQ_LENGTH=${SEQ_LENGTH:-2048}

GPT_ARGS=(
    --num-layers "${NUM_LAYERS:-24}" --hidden-size "${HIDDEN_SIZE:-2048}"
    --num-attention-heads "${NUM_ATTENTION_HEADS:-16}"
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --attention-dropout 0.0 --hidden-dropout 0.0
    --init-method-std 0.02
)
TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES")
if [[ -n "${TOKENIZER_FLAGS:-}" ]]; then read -ra TOKENIZER_ARGS <<< "$TOKENIZER_FLAGS"; fi
DATA_ARGS=(
    --data-path "$DATA_PREFIX" --split 949,50,1
    "${TOKENIZER_ARGS[@]}"
    --data-cache-path "$SAVE_DIR/data_cache"
)
case "${PRECISION:-bf16}" in
    bf16) PRECISION_ARGS=(--bf16) ;;
    fp16) PRECISION_ARGS=(--fp16) ;;
    *) PRECISION_ARGS=() ;;
esac
read -ra EXTRA <<< "${EXTRA_ARGS:-}"
TRAIN_ARGS=(
    --micro-batch-size "${MICRO_BATCH_SIZE:-4}" --global-batch-size "${GLOBAL_BATCH_SIZE:-512}"
    --train-iters "${TRAIN_ITERS:-100000}"
    --lr 2.0e-4 --min-lr 2.0e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
    "${PRECISION_ARGS[@]}" --zero-stage "${ZERO_STAGE:-1}"
    --log-interval "${LOG_INTERVAL:-10}"
    --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
    # --load names --save: a resubmitted or requeued job resumes from the last committed
    # checkpoint; with none there yet it starts from scratch (one warning line)
    --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval "${SAVE_INTERVAL:-1000}"
    --exit-signal-handler
    --tensorboard-dir "$SAVE_DIR/tensorboard"
    "${EXTRA[@]}"
)
