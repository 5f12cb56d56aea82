//! A seeded Kaiming-uniform initialization of `a`, identical on every rank.

/// `d_in * r` values of `a: [d_in, r]`, row-major, uniform in `±1 / sqrt(d_in)`: what peft's
/// default (`nn.init.kaiming_uniform_(lora_A.weight, a=sqrt(5))`, fan-in `d_in`) draws, from a
/// generator seeded by `seed` and the module `path`. Burn's own RNG is per thread, so ranks
/// (threads or processes) would draw different adapters from it.
pub(crate) fn kaiming_uniform(seed: u64, path: &str, d_in: usize, r: usize) -> Vec<f32> {
    let bound = 1.0 / (d_in as f64).sqrt();
    let mut state = seed ^ fnv1a(path);
    (0..d_in * r)
        .map(|_| {
            // The top 53 bits of a SplitMix64 draw: a uniform double in [0, 1).
            let u = (splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
            ((2.0 * u - 1.0) * bound) as f32
        })
        .collect()
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_bounded_seeded_and_differ_by_path() {
        let a = kaiming_uniform(7, "layers.0.q_proj", 16, 4);
        assert_eq!(a.len(), 64);
        assert!(a.iter().all(|v| v.abs() <= 0.25), "bound 1/sqrt(16)");
        assert!(a.iter().any(|v| v.abs() > 0.1), "spread over the range");
        assert_eq!(a, kaiming_uniform(7, "layers.0.q_proj", 16, 4));
        assert_ne!(a, kaiming_uniform(7, "layers.0.k_proj", 16, 4));
        assert_ne!(a, kaiming_uniform(8, "layers.0.q_proj", 16, 4));
    }
}
