//! Which of a model's layers per-layer activation checkpointing reaches
//! (`activation_checkpointing_scope`), as [`Parallelize::set_layer_checkpointing`] walks the
//! model: every layer, or only those inside the fields that declare a part
//! (`#[parallelize(part = "vision")]`).
//!
//! [`Parallelize::set_layer_checkpointing`]: crate::Parallelize::set_layer_checkpointing

/// The layers a checkpointing policy is set on, and the part of the model being visited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointScope<'a> {
    selected: Option<&'a str>,
    within: Option<&'a str>,
}

impl<'a> CheckpointScope<'a> {
    /// Every layer of the model, whatever part it is in (scope `"all"`).
    pub fn all() -> Self {
        Self {
            selected: None,
            within: None,
        }
    }

    /// Only the layers inside fields declared `#[parallelize(part = "<part>")]`, at any depth.
    pub fn part(part: &'a str) -> Self {
        Self {
            selected: Some(part),
            within: None,
        }
    }

    /// The scope seen from inside a field: the field's declared part when it has one, else the
    /// part its parent is in (a part covers everything below it).
    pub fn enter(self, part: Option<&'a str>) -> Self {
        Self {
            within: part.or(self.within),
            ..self
        }
    }

    /// Whether the `#[checkpoint]` field of the module being visited takes the policy.
    pub fn covers_here(&self) -> bool {
        match self.selected {
            None => true,
            Some(part) => self.within == Some(part),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::CheckpointScope;

    #[test]
    fn a_part_covers_what_is_below_its_field_and_nothing_else() {
        let vision = CheckpointScope::part("vision");
        assert!(!vision.covers_here(), "the root is in no part");
        assert!(vision.enter(Some("vision")).covers_here());
        assert!(vision.enter(Some("vision")).enter(None).covers_here());
        assert!(!vision.enter(Some("language")).covers_here());
        assert!(
            !vision
                .enter(Some("vision"))
                .enter(Some("language"))
                .covers_here(),
            "an inner part overrides the outer one"
        );
        let all = CheckpointScope::all();
        assert!(all.covers_here() && all.enter(Some("language")).covers_here());
    }
}
