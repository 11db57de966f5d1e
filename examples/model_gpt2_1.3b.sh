# Shared flags for the launch recipes in this folder: a GPT-2-style 1.3B model, bf16, ZeRO-1.
# Source it, then pass "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}" to pretrain_gpt.py.
# Override DATA_PREFIX, VOCAB, MERGES, SAVE_DIR in the environment.
DATA_PREFIX=${DATA_PREFIX:-/data/corpus_text_document}
VOCAB=${VOCAB:-/data/gpt2/vocab.json}
MERGES=${MERGES:-/data/gpt2/merges.txt}
SAVE_DIR=${SAVE_DIR:-/checkpoints/gpt2-1.3b}

GPT_ARGS=(
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16
    --seq-length 2048 --max-position-embeddings 2048
    --attention-dropout 0.0 --hidden-dropout 0.0
    --init-method-std 0.02
)
DATA_ARGS=(
    --data-path "$DATA_PREFIX" --split 949,50,1
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES"
    --data-cache-path "$SAVE_DIR/data_cache"
)
TRAIN_ARGS=(
    --micro-batch-size 4 --global-batch-size 512
    --train-iters 100000 --lr 2.0e-4 --min-lr 2.0e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
    --bf16 --zero-stage 1
    --log-interval 10 --eval-interval 1000 --eval-iters 10
    --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 1000
    --exit-signal-handler
    --tensorboard-dir "$SAVE_DIR/tensorboard"
)
