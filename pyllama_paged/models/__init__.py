"""Model downloads: references (refs), the local store (store), the resumable HTTP
download primitive (download), the Hugging Face Hub (hub) and Ollama registries
(ollama_registry) as sources, and the pull that ties them together (pull)."""
