# GPU image for clusters: the project installed over NGC PyTorch's own CUDA torch (never a second torch).
# Build: docker build -t pretrain .   (not built on the development machine: it has no Docker engine)
FROM nvcr.io/nvidia/pytorch:25.10-py3

WORKDIR /workspace/pretrain
COPY . .

# Pin whatever torch the base image ships, so no dependency can replace it with a PyPI build;
# deepspeed builds against that torch (its setup.py imports torch, hence --no-build-isolation).
# The dev extras too: `make gpu-check` runs the test suite (conftest needs them at import).
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
 && pip install --no-cache-dir -c /tmp/torch-constraint.txt ninja packaging psutil py-cpuinfo pydantic hjson msgpack \
 && pip install --no-cache-dir -c /tmp/torch-constraint.txt --no-build-isolation "deepspeed>=0.16,<0.20" \
 && pip install --no-cache-dir -c /tmp/torch-constraint.txt -e ".[dev]" \
 && python -c "import torch, deepspeed, pretrain; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

ENV OMP_NUM_THREADS=8
CMD ["bash"]
