"""OpenAI's dialect: chat and completions, Responses, logprobs, tokenize."""
