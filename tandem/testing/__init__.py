"""What the tests, the benchmarks and the scripts share: random-weight checkpoints, real
engine and server processes, streamed clients, references to compare against, the GGUF
checkpoints the slow tests read. Needs the dev dependencies (transformers, httpx)."""
