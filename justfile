# Conveniences; the README's commands do not need `just` (install: cargo install just --locked).

# run the tests, exactly as CI does
test:
    bash .ci/run

# check the quantizer against the golden vectors
golden:
    cargo run --release -- quantize --check tests/golden

# quantizer throughput vs copy (1 core and all cores)
bench-quantize:
    cargo run --release -- bench quantize
