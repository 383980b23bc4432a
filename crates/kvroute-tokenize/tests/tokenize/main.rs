//! Tests of kvroute-tokenize: known token ids, chat templates, prompt shapes and
//! errors. One test binary (modules below) keeps linking cheap.

mod huggingface;
mod prompt;
mod properties;
mod tiktoken;
