"""Model Optimizer 0.47's NVFP4 recipes on CPU, on the demo model in transformers' DeepseekV3 (issue 16).

- `fake_quant`: pure-torch twins of Model Optimizer's two Triton NVFP4 fake-quant kernels (checked bit-exact
  against them under Triton's CPU interpreter in tests/bench/test_modelopt_cpu_fake_quant.py);
- `patch`: `modelopt_on_cpu()`, which routes Model Optimizer's CPU calls to those twins so its calibration
  algorithms run unmodified;
- `hf_model`: the INT4 demo checkpoint dequantized exactly into transformers' DeepseekV3ForCausalLM;
- `recipes`: the five NVFP4 recipes restricted to the routed experts, run and exported into a copy of a
  converted checkpoint so validate measures them like our own methods.
"""
