//! Hugging Face chat templates, rendered with minijinja the way `transformers`
//! renders them with Jinja2.
//!
//! A template sees what `apply_chat_template` passes: `messages` (each with
//! `role` and `content`), `add_generation_prompt`, the tokenizer's special
//! tokens (`bos_token`, `eos_token`, ...) as strings, and the helpers
//! `raise_exception(message)` and `strftime_now(format)`. Like transformers, the
//! environment trims blocks and strips their leading whitespace, supports
//! `break`/`continue`, and answers Python string, list and dict methods
//! (`.strip()`, `.startswith()`, `.get()`, `.items()`, ...). Undefined values
//! render as empty, as in Jinja2's default, and `tojson` writes maps in their
//! insertion order with Python's separators, as `json.dumps` does.

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::{Environment, Error, ErrorKind, Value};

use crate::{ChatMessage, TokenizeError};

const TEMPLATE_NAME: &str = "chat_template";

pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... as the template sees them.
    special_tokens: BTreeMap<String, String>,
}

impl ChatTemplate {
    /// Compiles `source`; `path` names the file it came from in errors.
    pub(crate) fn new(
        source: String,
        special_tokens: BTreeMap<String, String>,
        path: &Path,
    ) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are valid");
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|error| TokenizeError::InvalidFile {
                path: path.to_path_buf(),
                message: format!("chat template does not compile: {error}"),
            })?;
        Ok(ChatTemplate {
            env,
            special_tokens,
        })
    }

    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let mut context: BTreeMap<&str, Value> = self
            .special_tokens
            .iter()
            .map(|(name, token)| (name.as_str(), Value::from(token.as_str())))
            .collect();
        let messages: Vec<Value> = messages
            .iter()
            .map(|message| {
                // In the order clients send them, which `tojson` keeps.
                Value::from_pairs([
                    ("role", Value::from(message.role.as_str())),
                    ("content", Value::from(message.content.as_str())),
                ])
            })
            .collect();
        context.insert("messages", Value::from(messages));
        context.insert("add_generation_prompt", Value::from(add_generation_prompt));
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("the template was added at construction");
        template.render(context).map_err(|error| {
            let message = match (error.kind(), error.detail()) {
                // raise_exception: the template's own words for the client.
                (ErrorKind::InvalidOperation, Some(detail)) => detail.to_string(),
                _ => error.to_string(),
            };
            TokenizeError::ChatTemplate { message }
        })
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// The local time formatted like Python's `datetime.now().strftime(format)`;
/// Llama 3.x templates put today's date in the system prompt with it.
fn strftime_now(format: String) -> Result<String, Error> {
    jiff::fmt::strtime::format(format.as_str(), &jiff::Zoned::now()).map_err(|error| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now({format:?}): {error}"),
        )
    })
}
