//! Routed slots sorted by expert: the permutation every MoE forward needs, on the host.

use crate::error::EpError;

/// The routed slots of one MoE layer's tokens (`tokens * k` of them, slot `t * k + j` being
/// token `t`'s `j`-th choice), sorted by expert. Sorting is stable, so within one expert the
/// slots keep token order, which makes the exchange deterministic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routing {
    /// Slot indices in expert-major order.
    pub order: Vec<usize>,
    /// Slots routed to each expert (`counts.len()` is the expert count).
    pub counts: Vec<usize>,
}

impl Routing {
    /// The routing of slots whose experts are `experts_of_slots`, over `num_experts` experts.
    pub fn new(experts_of_slots: &[usize], num_experts: usize) -> Result<Self, EpError> {
        let mut counts = vec![0; num_experts];
        for (slot, &expert) in experts_of_slots.iter().enumerate() {
            if expert >= num_experts {
                return Err(EpError::NoSuchExpert {
                    slot,
                    expert,
                    experts: num_experts,
                });
            }
            counts[expert] += 1;
        }
        let mut order: Vec<usize> = (0..experts_of_slots.len()).collect();
        order.sort_by_key(|&slot| experts_of_slots[slot]);
        Ok(Self { order, counts })
    }

    /// For each slot, its position in [`order`](Self::order): the permutation back.
    pub fn inverse(&self) -> Vec<usize> {
        let mut inverse = vec![0; self.order.len()];
        for (position, &slot) in self.order.iter().enumerate() {
            inverse[slot] = position;
        }
        inverse
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_stably_by_expert_and_inverts() {
        let r = Routing::new(&[2, 0, 2, 1, 0], 4).unwrap();
        assert_eq!(r.order, vec![1, 4, 3, 0, 2]);
        assert_eq!(r.counts, vec![2, 1, 2, 0]);
        let inv = r.inverse();
        for (pos, &slot) in r.order.iter().enumerate() {
            assert_eq!(inv[slot], pos);
        }
    }

    #[test]
    fn an_unknown_expert_is_named() {
        let e = Routing::new(&[0, 5], 4).unwrap_err().to_string();
        assert!(
            e.contains("slot 1") && e.contains("expert 5") && e.contains("4 experts"),
            "{e}"
        );
    }
}
