"""What the benchmark scripts share; no script imports another script.

- report: machine/build info, markdown tables, the JSON + markdown pair every script writes
  (write_report: the usual ending, with the options and the plot);
- options: the options many scripts take (--threads, --model, --out, ...), declared once, each
  script giving its own defaults;
- peers: llama.cpp's tools (built, found, started) and our server started the same way;
- roofline: the bandwidth and int8 ceilings of this machine and what they allow a step;
- model_files: the F16/BF16/Q4_0 exports of the default model some benchmarks run;
- conversations: word prompts of given token lengths (window_capacity, window_answers).

A script under bench/<shelf>/ runs as `python -m bench.<shelf>.<script>` from the checkout's root
and imports `bench.common.<module>`.
"""
