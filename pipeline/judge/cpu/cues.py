"""Lexical cues of a user's reply: praise, complaint or correction, holding on, asking.

A sentence embedding places "this works" and "this doesn't work" close together; the words that
carry the verdict are few and well known, in English and in the languages users write in. This
module counts them, with a short negation scope ("not great", "haven't fixed", "nicht richtig")
and phrases whose negation is praise ("no problem", "not bad", "no more errors"), and splits off
the clause after a contrast ("thanks, but ...", "aber", "mais", "pero", "但是", "でも").

:func:`cue_vector` gives the counts as a small float vector, one of the inputs of the judge's
classifier head (:mod:`pipeline.judge.cpu.classifier`), next to the sentence embedding.
The word lists are our own; they cover English, German, French, Spanish, Italian, Portuguese,
Dutch, Russian, Polish, Turkish, Swedish, Chinese, Japanese and Korean.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


def _words(*alts: str) -> re.Pattern:
    """Alternatives matched as whole words (letters of any script around them break a match)."""
    return re.compile(r"(?<![\w])(?:" + "|".join(alts) + r")(?![\w])", re.I)


def _chars(*alts: str) -> re.Pattern:
    """Alternatives matched anywhere (scripts without spaces between words)."""
    return re.compile("|".join(alts))


# praise spelled with a negative word ("no problem", "the error is gone"): counted as praise and
# removed before the other cues are counted
_PRAISE_PHRASES = _words(
    r"no (?:problem|problems|worries|issues?) (?:at all|now|anymore|any more)?", r"no worries", r"no problem",
    r"not bad", r"can'?t complain", r"couldn'?t be better", r"no complaints",
    r"no (?:more|longer any) (?:errors?|warnings?|crash(?:es)?|issues?|problems?|bugs?|failures?)",
    r"(?:doesn'?t|does not|don'?t|won'?t|isn'?t) (?:crash|fail|error|hang|freeze|break)(?:ing|s)? (?:anymore|any more)",
    r"never (?:been|felt|looked|worked) better", r"thanks? (?:you )?again",
    r"no (?:errors?|warnings?|issues?|problems?|crash(?:es)?) (?:now|anymore|any more|this time)",
    r"(?:the )?(?:errors?|bugs?|problems?|issues?|crash(?:es)?|warnings?|leak) (?:is |are |has |have )?"
    r"(?:gone|fixed|solved|resolved|went away|disappeared)", r"kein problem", r"pas de (?:problème|souci)",
    r"sin problema",
    r"de nada", r"nessun problema", r"sem problema", r"geen probleem", r"без проблем", r"нет проблем")

_POSITIVE_EN = _words(
    r"thanks?", r"thank you", r"thx", r"ty", r"tysm", r"cheers", r"appreciated?", r"grateful",
    r"perfect(?:ly)?", r"great", r"awesome", r"excellent", r"brilliant", r"fantastic", r"wonderful", r"amazing",
    r"superb", r"outstanding", r"lovely", r"beautiful(?:ly)?", r"sweet", r"neat", r"cool", r"nice(?:ly)?",
    r"good job", r"well done", r"good work", r"nice work", r"great work", r"love(?:d|s)? (?:it|this|that)", r"love",
    r"exactly", r"precisely", r"spot on", r"nailed it", r"bingo", r"that'?s it", r"that'?s the one",
    r"correct", r"right on", r"that'?s right", r"you'?re right", r"yes", r"yep", r"yup", r"yeah", r"ya",
    r"works", r"worked", r"working (?:now|again|fine|great|perfectly)", r"runs", r"compiles", r"passes",
    r"passed", r"(?:is |all |back to )green", r"green again",
    r"fixed", r"solved", r"resolved", r"sorted", r"did the trick", r"does the trick", r"helps", r"helped",
    r"helpful", r"useful", r"clear", r"makes sense", r"made sense", r"lgtm", r"looks good", r"sounds good",
    r"looks great", r"sounds great", r"good", r"fine", r"ok(?:ay)? (?:great|perfect|cool|thanks)", r"lifesaver",
    r"life saver", r"the best", r"genius", r"clever", r"smart", r"impressive", r"agreed", r"matches",
    r"checks out", r"confirmed", r"ta", r"merci", r"danke", r"gracias", r"grazie", r"obrigad[oa]",
    r"much better", r"way better", r"haha+", r"yay", r"woo+", r"finally", r"incredible", r"wow", r"huge",
    r"massive", r"game ?changer", r"true", r"got it (?:working|running|to work)",
    r"(?:it'?s |is )?(?:working|running) now",
    r"^done\b", r"[\w-]+ it is[!.]*$", r"went through", r"worked out", r"came through", r"(?:has |have )?arrived",
    r"got (?:a|an|the|my) (?:[\w-]+ )?(?:invite|invitation|offer|confirmation|refund|job|approval|reply)", r"^next\b",
    r"next(?: one| question| step| task| up)?:", r"^clean[.!]",
    r"(?:very|so|nice and|super) clean",
    r"(?:much|way|so much|a lot|far) (?:better|clearer|nicer|cleaner|faster|more (?:readable|diplomatic|natural|"
    r"professional|polished|concise))", r"sent it", r"(?:it'?s |been )?sent(?=[.!]*$)",
    r"i (?:really |especially |do |quite |just |absolutely )?(?:like|liked|love|loved|enjoy(?:ed)?|adore)",
    r"you'?re (?:a |the )?(?:star|legend|hero|genius|gem|champ|best)",
    r"(?:good|great|nice) (?:call|catch|idea|pick|point)",
    r"going with (?:it|this|that)", r"(?:i'?ll|we'?ll|gonna) (?:use|take|go with) (?:it|this|that)",
    r"(?:i'?m |i'?ll |we'?ll |we'?re |going to |gonna )(?:print|send|ship|merge|post|use|using|printing|sending|"
    r"shipping|merging|posting) (?:it|this|that|them)", r"(?:back|up) and running",
    r"good to go", r"all set", r"all good", r"that'?s (?:great|perfect|awesome|lovely|helpful|brilliant)")
_POSITIVE_OTHER = _words(
    r"ja", r"jawohl", r"oui", r"sí", r"sim", r"да", r"tak", r"evet", r"ja(?:, )?precies",
    # de
    r"danke(?: schön| sehr| dir)?", r"viel besser", r"sehr gut", r"vielen dank", r"perfekt", r"super", r"klasse",
    r"genau", r"stimmt",
    r"richtig", r"funktioniert", r"klappt", r"toll", r"prima", r"passt", r"wunderbar", r"geil", r"spitze",
    # fr
    r"merci(?: beaucoup)?", r"parfait", r"génial", r"exactement", r"ça marche", r"ca marche", r"ça fonctionne",
    r"fonctionne", r"nickel", r"impeccable", r"top", r"bravo", r"excellent", r"c'?est (?:ça|bon|juste|correct)",
    r"mignon", r"adore", r"adorer", r"bien vu", r"bien joué", r"beaucoup mieux", r"c'?est mieux",
    # es / pt / it
    r"gracias", r"muchas gracias", r"perfecto", r"genial", r"exacto", r"correcto", r"funciona", r"funcionó",
    r"excelente", r"muy bien", r"vale", r"buenísimo", r"grazie(?: mille)?", r"perfetto", r"esatto", r"corretto",
    r"ottimo", r"bravo", r"obrigad[oa]", r"perfeito", r"exato", r"correto", r"funcionou", r"ótimo", r"valeu",
    r"deu certo", r"certo",
    # nl / sv / pl / tr
    r"bedankt", r"dank je(?: wel)?", r"dankjewel", r"klopt", r"werkt", r"top", r"tack", r"fungerar", r"bra",
    r"dzięki", r"dziękuję", r"idealnie", r"działa", r"świetnie", r"super", r"teşekkür(?:ler| ederim)?",
    r"sağol", r"mükemmel", r"doğru", r"çalıştı", r"çalışıyor",
    # ru
    r"спасибо", r"благодарю", r"отлично", r"идеально", r"правильно", r"верно", r"работает", r"супер",
    r"точно", r"класс", r"здорово")
_POSITIVE_CJK = _chars(
    r"谢谢", r"多谢", r"感谢", r"完美", r"对了", r"正确", r"可以了", r"好的", r"没问题", r"太好了", r"成功",
    r"解决了", r"运行正常", r"就是这个", r"厉害", r"ありがとう", r"完璧", r"正しい", r"できました", r"動きました",
    r"助かり", r"いいね", r"素晴らしい", r"감사", r"고마워", r"완벽", r"맞아", r"정확", r"잘 돼", r"좋아요",
    r"是的", r"はい", r"네", r"👍", r"🙏", r"✔", r"☑", r"🚀", r"✨", r"🥳", r"😁", r"😃", r"🤩", r"💪", r"⭐", r"🌟",
    r"👏", r"🤗", r"😻", r"🎊", r"💖", r"💚", r"💙", r"🤝", r"✌", r"😎", r"🥰", r"☺", r"🙂", r"😆", r"😂", r"🎉", r"✅", r"👌", r"❤",
    r"😍", r"🙌", r"💯", r"🔥", r"😊", r"😀", r"😄")

_NEGATIVE_EN = _words(
    r"no", r"nope", r"nah", r"wrong(?:ly)?", r"incorrect", r"inaccurate", r"false", r"mistakes?", r"typos?",
    r"errors?", r"exceptions?", r"fails?", r"failed", r"failing", r"failure", r"broken", r"breaks", r"broke",
    r"bugs?", r"buggy", r"crash(?:es|ed|ing)?", r"hangs?", r"freezes", r"segfaults?", r"worse", r"slower",
    r"useless", r"pointless", r"nonsense", r"garbage", r"rubbish", r"awful", r"terrible", r"horrible",
    r"unusable", r"unhelpful", r"meh", r"ugh+", r"sigh", r"seriously", r"come on", r"wtf", r"ffs",
    r"misunderst(?:ood|and)", r"misread", r"missed", r"missing", r"forgot", r"forgotten", r"ignored?",
    r"ignoring", r"skipped", r"left out", r"made (?:it|that) up", r"made up", r"hallucinat\w*", r"invented",
    r"doesn'?t exist", r"does not exist", r"outdated", r"deprecated", r"dead link", r"off by",
    r"too (?:long|short|wordy|verbose|formal|casual|informal|technical|simple|complex|complicated|vague|generic|"
    r"much|many|few|little|slow|big|small|basic|advanced|dense|stiff|cheesy|bland|boring|repetitive)",
    r"way too", r"shorter", r"longer", r"simpler", r"more (?:concise|formal|casual|detailed|specific)",
    r"less (?:formal|wordy|technical)",
    r"(?<!what )(?<!how )i (?:said|asked|meant|told you|wanted|specified|mentioned|needed)",
    r"i already", r"not what i", r"that'?s not", r"that is not", r"this is not", r"this isn'?t", r"that isn'?t",
    r"isn'?t (?:right|correct|it|what)", r"absolutely not", r"definitely not", r"of course not", r"hell no",
    r"never (?:received|got|arrived|came|showed up|worked|loaded|answered)",
    r"(?:hasn'?t|haven'?t|didn'?t|has not|have not|did not) (?:arrived|received|come|got|gotten|shown up|changed)",
    r"(?:nobody|no one|nothing) (?:can|could|works?|worked|loads?|happens|happened|changed|shows?|showed)",
    r"(?:is|are|was|were|looks|seems) (?:off|wrong|incorrect|broken|missing|empty)",
    r"you (?:left|put) (?:out|in|half|the|a|it)", r"you still", r"^(?:almost|nearly|close)\b[.!,]",
    r"i (?:don'?t|do not|can'?t|cannot) (?:see|find)",
    r"^(?:it'?s|it is|should be|actually) (?!right|correct|true|fine|great|perfect|good|ok|okay|it|done)"
    r"[\w.,'-]+[.!]?$",
    r"^[\w.,'-]+\*$",
    r"(?<=[,;]) ?(?:pas|nicht|no|non|não|не|nie)\s+[\w'-]+",
    r"ich wollte", r"je voulais", r"quería", r"eu queria", r"volevo", r"ik wilde", r"я хотел[аи]?", r"try again",
    r"redo", r"re-?do",
    r"(?:do|write|say|check|read|explain|answer|run|look|fix) (?:it |that |this |them )?again", r"not again",
    r"(?:wrong|broken|failing|failed|crash\w*|errors?|stuck|empty) again", r"again\?", r"once again",
    r"something'?s (?:off|wrong|not right|missing|broken)", r"(?:exits?|quits?|dies|closes) (?:right away|immediately)",
    r"(?:returns?|returning|got|getting|gives?|giving|throws?|throwing|shows?|showing|prints?|printing) "
    r"(?:a |an |me )?(?:[45]\d\d|errors?|exceptions?|null|none|nan|undefined|nothing|garbage|zeros?|empty|blank)",
    r"(?<=[,;]) ?not (?:a |an |the )?[\w'-]+", r"(?:should|needs? to|has to|must) be", r"that was the first thing",
    r"already (?:tried|did|done|said|told|checked|asked|mentioned)", r"(?:even|still) (?:worse|slower|more)",
    r"one more time", r"rewrite", r"re-?write", r"fix (?:it|this|that|the)", r"please fix",
    r"should (?:be|have|say|read)", r"supposed to", r"actually,? it'?s", r"backwards",
    r"the opposite",
    r"still (?:not|doesn'?t|does not|broken|crash\w*|fail\w*|wrong|the same|getting|get|gives|can'?t|won'?t|no|red|"
    r"there|missing|hasn'?t|isn'?t|shows?|happen\w*|see|too|has|have|seeing|empty|slow|off)",
    r"same (?:error|problem|issue|thing|mistake|result|output|answer)",
    r"not (?:quite|really|exactly|right|correct|working|helpful|useful|good|great|it|what|the)",
    r"you (?:didn'?t|did not|haven'?t|have not|forgot|missed|ignored|skipped|keep|changed|deleted|removed|broke)",
    r"(?:doesn'?t|does not|didn'?t|did not|don'?t|won'?t|can'?t|cannot|isn'?t|wasn'?t|aren'?t) "
    r"(?:even |really |actually |always |quite )?(?:work|run|compile|load|open|start|help|answer|match|build|"
    r"install|print|render|make sense|fit|rhyme|"
    r"change|do anything|exist)\w*",
    r"drop (?:the|it)", r"remove (?:the|it|that)", r"change (?:the|it|this|that)",
    r"make it (?:shorter|longer|simpler|more|less|sound|rhyme|formal|casual|\w+er)",
    r"don'?t use", r"no (?:emojis?|bullet points?|jargon|more)", r"why (?:did|would) you", r"are you (?:sure|kidding)",
    r"did you (?:even )?read", r"thanks for nothing", r"read (?:my|the) question", r"wall of text")
_NEGATIVE_OTHER = _words(
    # de
    r"nein", r"falsch", r"stimmt nicht", r"nicht richtig", r"funktioniert nicht", r"geht nicht", r"klappt nicht",
    r"fehler", r"nochmal", r"noch einmal", r"zu lang", r"zu kurz", r"ich meinte", r"nicht gefragt",
    r"immer noch", r"viel zu",
    # fr
    r"non", r"faux", r"incorrect", r"pas correct", r"ne marche pas", r"marche pas", r"ne fonctionne pas",
    r"erreur", r"encore", r"trop (?:long|court|compliqué|formel)", r"beaucoup trop", r"je voulais dire",
    r"ce n'?est pas", r"c'?est pas", r"pas ce que", r"toujours la même",
    # es / pt / it
    r"mal", r"incorrecto", r"equivocad[oa]", r"no funciona", r"sigue sin", r"otra vez", r"de nuevo",
    r"demasiado", r"quise decir", r"no es", r"eso no", r"sbagliato", r"non funziona", r"errore", r"di nuovo",
    r"troppo", r"non è", r"intendevo", r"errado", r"incorreto", r"não funciona", r"erro", r"ainda",
    r"não é", r"muito longo",
    # nl / sv / pl / tr
    r"não", r"nao", r"nee", r"fout", r"verkeerd", r"werkt niet", r"opnieuw", r"te lang", r"klopt niet", r"fel",
    r"fungerar inte",
    r"źle", r"błąd", r"nie działa", r"yanlış", r"hata", r"çalışmıyor",
    # ru
    r"нет", r"неправильно", r"неверно", r"не работает", r"ошибка", r"снова", r"опять", r"слишком", r"не то",
    # "still broken", "I said / asked for X", "please correct": the same kinds in other languages
    r"noch immer", r"immer noch nicht", r"nicht das", r"(?:ich )?hatte (?:ich )?(?:doch )?(?:gesagt|geschrieben|gefragt)",
    r"bitte (?:korrigieren|ändern|anpassen)", r"korrigier\w*", r"toujours pas", r"j'?avais (?:dit|demandé|précisé)",
    r"j'?ai (?:dit|demandé|précisé)", r"corrige[zr]?", r"todavía no", r"sigue (?:igual|fallando|dando)",
    r"(?:te|lo) dije", r"(?:yo )?ped[íi]", r"corr[ií]gelo", r"ancora (?:non|lo stesso|uguale)", r"avevo (?:detto|chiesto)",
    r"ho chiesto", r"correggi\w*", r"ainda não", r"eu (?:disse|pedi)", r"corrija", r"nog steeds", r"niet goed",
    r"ik (?:zei|vroeg|had gezegd|had gevraagd)", r"pas (?:dat|het|dit) (?:even )?aan", r"aanpassen", r"nadal",
    r"wciąż", r"przecież", r"prosił(?:em|am)", r"pisał(?:em|am)", r"mówił(?:em|am)", r"popraw\w*", r"nie to",
    r"всё ещё", r"все еще", r"до сих пор", r"я (?:же )?(?:просил[а]?|писал[а]?|говорил[а]?)", r"исправ\w*",
    r"hâlâ", r"demiştim", r"düzelt\w*")
_NEGATIVE_CJK = _chars(
    r"不对", r"错了", r"错误", r"不行", r"不是", r"还是", r"重新", r"太长", r"报错", r"没用", r"不能",
    r"いいえ", r"違います", r"間違", r"動かない", r"動きません", r"エラー", r"もう一度", r"長すぎ", r"だめ", r"ダメ",
    r"틀렸", r"아니", r"안 돼", r"오류", r"다시", r"너무 길", r"太短", r"我要的是", r"我说的是", r"我说过", r"不是这个",
    r"怎么还", r"还是不", r"まだ同じ", r"まだ壊れ", r"まだエラー", r"まだ動", r"壊れ", r"と書きましたよね", r"と言いましたよね",
    r"ましたよね", r"無理です", r"じゃなくて", r"ではなく", r"違う", r"잘못", r"아직도", r"아니라", r"했잖아", r"말했는데",
    r"안 되", r"없는데요", r"너무 짧", r"👎", r"🙄", r"😡", r"😤", r"😠", r"😞", r"😢", r"😭", r"🤦",
    r"🙁", r"☹", r"😒", r"😑", r"🤬", r"😩", r"😫", r"💩", r"❌", r"🤷")

_RELATIVE = re.compile(r"\b(?:what|which|whatever|if|whether) (?:was|is|were|gets?|got|has been|it) $", re.I)
_IGNORE = _words(r"no way", r"no idea", r"no clue", r"no rush", r"no hurry", r"yes or no", r"if not")
_SARCASM = _words(  # irony markers: praise next to them is not trusted
    r"oh (?:great|perfect|wonderful|brilliant|fantastic|joy|lovely|sure|awesome)",
    r"(?:great|perfect|wonderful|brilliant|fantastic|lovely|awesome|amazing|excellent|super),? (?:just|now|another|so)",
    r"ah yes,? the", r"oh yes,? the", r"the famous", r"groundbreaking", r"revolutionary", r"genius move",
    r"sure it (?:is|does|will|works)", r"yeah,? sure", r"because that'?s", r"as if",
    r"just what i (?:needed|wanted|asked for)", r"thanks for nothing", r"yeah,? right",
    r"sure,? (?:fine|thing|because)", r"totally", r"very (?:helpful|useful|clever|funny)[.!]", r"so helpful",
    r"real(?:ly)? helpful", r"bravo,", r"slow clap", r"wow,? (?:thanks|great|just)", r"thanks a lot[.!]*$",
    r"another (?:wall|essay|error|lecture|history lesson|novel)", r"love how you",
    r"i love (?:how|that) you (?:ignored|keep|broke|deleted)", r"good job breaking", r"nice try",
    r"very (?:centred|centered|short|brief|concise|helpful|descriptive|original|useful|clear)[.!]",
    r"i'?ll just (?:go )?\w+", r"classic[.!]*$", r"just go", r"what a surprise", r"who knew", r"how original",
    r"(?:^|[.!] )(?:brilliant|genius|great|perfect|wonderful|fantastic|amazing|lovely)\.(?= \w)",
    r"/s", r"bravissim[oa]", r"nothing says [\w ]{1,30} like", r"good to know\W*$", r"why didn'?t i think of that")
_TROUBLE = _words(  # words of things going wrong: praise next to them may be ironic ("great, it deleted everything")
    r"deleted", r"lost", r"broke", r"broken", r"worse", r"slower", r"crash\w*", r"nothing", r"nobody",
    r"no one", r"never", r"wasted?", r"hours", r"twice", r"another", r"anymore", r"any more",
    r"ruined", r"destroyed", r"wiped", r"overw\w+", r"disappeared", r"vanished", r"stuck", r"hung", r"frozen",
    r"freez\w*", r"useless", r"mess", r"chaos", r"disaster", r"empty", r"blank", r"missing", r"wrong", r"error\w*",
    r"fail\w*", r"bug\w*", r"3 ?am", r"weekend", r"all night", r"every time", r"each time", r"of course",
    r"obviously", r"clearly", r"apparently", r"somehow", r"literally", r"exactly what i (?:didn'?t|did not)")
_DEFERRED = _words(  # the user has not checked the result yet
    r"(?:i'?ll|i will|will|gonna|going to|let me|need to|have to|want to) (?:try|test|check|verify|look|see|run|"
    r"get back|report|let you know|think|confirm|review|read)", r"(?:haven'?t|have not|not) (?:tried|tested|checked|"
    r"run|read) (?:it |this |that )?yet", r"not (?:sure|tested) yet", r"we'?ll see", r"(?:ich|je|yo|vou|vado) "
    r"(?:teste|testerai|probaré|testar|provo)", r"später", r"plus tard", r"más tarde", r"mais tarde", r"più tardi")
_NEGATOR = re.compile(r"(?<![\w])(?:not|never|no longer|hardly|n't|nicht|pas|nunca|non|не|没|不)(?![\w])|n't", re.I)
_HOLD = _words(
    r"wait", r"hold on", r"one sec(?:ond)?", r"a sec", r"a moment", r"a minute", r"brb", r"afk", r"later",
    r"tomorrow", r"next week", r"on monday", r"let me (?:think|check|see|try|look|run|test|compare|ask)",
    r"i'?ll (?:try|test|check|look|see|get back|report|think|ask|come back|add|do)", r"i'?m going to (?:try|test|ask)",
    r"not sure(?: yet)?", r"need to think", r"think (?:it )?over", r"we'?ll see", r"moment bitte", r"später",
    r"demain", r"mañana", r"depois", r"aspetta", r"un momento", r"подожди", r"позже", r"domani", r"morgen",
    r"back in a (?:bit|sec|minute|moment)", r"be right back", r"not at (?:my|the) (?:pc|computer|desk|laptop)",
    r"non sono al (?:pc|computer)", r"nicht am (?:rechner|pc|computer)", r"pas devant (?:mon|l'?)ordi\w*",
    r"jutro", r"później", r"завтра", r"yarın")
_HOLD_CJK_EXTRA = (r"明天", r"一会儿", r"回头", r"明日", r"後で", r"あとで", r"내일", r"나중에")
_HOLD_CJK = _chars(r"等一下", r"稍等", r"ちょっと待って", r"잠깐", *_HOLD_CJK_EXTRA)
_CONTRAST = re.compile(
    r"(?<![\w])(?:but|however|though|although|except|apart from|other than|only thing|just one thing|only problem|"
    r"aber|jedoch|mais|cependant|"
    r"pero|sin embargo|però|ma|mas|porém|maar|но|однако|ale|ama)(?![\w])|但是|但|不过|可是|でも|けど|하지만|그런데",
    re.I)
_CORRECTION_FORM = _words(  # the shape of a correction or a change request, without a verdict word
    r"i think", r"i believe", r"should", r"could you", r"can you", r"would you", r"please", r"needs? to",
    r"has to", r"have to", r"actually", r"usually", r"instead", r"rather than", r"only", r"just", r"it'?s (?:a|an|the)",
    r"bitte", r"sollte", r"s'il (?:te|vous) pla[iî]t", r"devrait", r"por favor", r"debería", r"per favore")
_CONTINUATION = re.compile(r"(?:otherwise|overall|all in all|anyway|in general|apart from that|other than that|"
                           r"still (?:great|good|perfect|helpful|useful)|sonst|ansonsten|sinon|por lo demás|"
                           r"per il resto)\b", re.I)
_MOVING_ON = _words(r"next", r"now (?:can|could|would|do|let'?s|write|make|try|show|help)", r"another", r"also",
                    r"moving on", r"let'?s (?:move on|do|try)", r"new (?:question|task)")
_QUESTION_START = _words(
    r"why", r"how", r"what", r"which", r"where", r"when", r"who", r"is there", r"are there", r"can i", r"could i",
    r"should i", r"would (?:it|that|you)", r"does (?:it|this|that)", r"do you", r"is (?:it|this|that)",
    r"warum", r"wie", r"was", r"pourquoi", r"comment", r"quel", r"por qué", r"cómo", r"qué", r"perché", r"come",
    r"почему", r"как", r"что")


_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:[.,]\d+)*")


def _numbers(text: str) -> set[str]:
    return {n.replace(",", "") for n in _NUMBER.findall(text or "")}


def conflicting_number(reply: str, response: str) -> bool:
    """A short reply that states a number the assistant's response did not give, while the
    response gave numbers ("it's 210" after "350"): the user is correcting a value."""
    if not response or len((reply or "").split()) > 8 or (reply or "").rstrip().endswith(("?", "？")):
        return False
    said, told = _numbers(reply), _numbers(response)
    return bool(said and told and said - told)


# one or two words trailing off ("shakespeare...") or starred ("ankara*"): a terse correction
_TERSE_CORRECTION = re.compile(r"^(?!(?:hmm+|ok|okay|well|so|uh+|um+|sure|right|wait|yes|yeah|and|but|oh|ah|ha+|lol)\b)"
                               r"[^\W\d_][\w'-]*(?: [\w'-]+)?(?:\.\.\.|…|\*)$", re.I)
_CONTENT_WORD = re.compile(r"[^\W\d_]{4,}")
_STOP = {"that", "this", "with", "have", "from", "what", "your", "will", "just", "please", "about", "would", "could",
         "should", "there", "their", "them", "then", "than", "they", "were", "been", "being", "into", "also", "only",
         "some", "more", "less", "very", "much", "does", "want", "need", "make", "like", "here", "when", "where"}


def restates_request(reply: str, request: str) -> bool:
    """A short reply made mostly of the request's own content words ("vegan. VEGAN." after
    "recommend a vegan restaurant"): the user repeats what was asked, the reply missed it."""
    if not request or len((reply or "").split()) > 12 or (reply or "").rstrip().endswith(("?", "？")):
        return False
    words = {w.lower() for w in _CONTENT_WORD.findall(reply)} - _STOP
    asked = {w.lower() for w in _CONTENT_WORD.findall(request)} - _STOP
    return bool(words) and len(words & asked) / len(words) >= 0.6


@dataclass(frozen=True)
class Cues:
    """Counts of cue words in one text (after praise-by-negation phrases are taken out)."""

    positive: int
    negative: int
    negated_positive: int
    hold: int
    question: bool
    contrast_negative: bool  # a contrast ("but ...") whose clause after it reads as a complaint
    sarcasm: int  # irony markers ("oh great, ...", "just what I needed")
    correction: int  # correction or change-request shapes ("should", "could you", "please", "instead")
    chars: int
    strong_positive: int = 0  # positive cues other than weak, irony-prone ones ("great", "nice", "sure")
    trouble: int = 0  # words of things going wrong, outside praise phrases ("deleted", "hours", "nothing")
    deferred: bool = False  # the user will check later ("I'll try it tomorrow")
    number_conflict: bool = False  # a short reply stating a value the response did not give (needs the response)
    restatement: bool = False  # a short reply repeating the request's words (needs the request)

    @property
    def negative_total(self) -> int:
        return (self.negative + self.negated_positive + (2 if self.contrast_negative else 0)
                + (1 if (self.number_conflict or self.restatement) and not self.positive else 0))

    @property
    def polarity(self) -> int:
        """+1 / -1 when the cues point one way only; 0 when none or both (a contrast whose
        clause complains counts as -1)."""
        neg = self.negative_total
        if self.contrast_negative:
            return -1
        if self.positive and not neg and not self.sarcasm:
            return 1
        if neg and not self.positive:
            return -1
        return 0


_WEAK_PRAISE = re.compile(r"(?:great|good|nice|cool|fine|sweet|neat|ok(?:ay)?|sure|wow|true|yes|yeah|yep|yup|ya|ja|"
                          r"oui|sí|sim|да|right|clear|better|finally|haha+|incredible|huge|massive|ta|lol)[.!]*", re.I)


def _count_strong(text: str) -> int:
    """Positive cues other than the weak, irony-prone ones ("great", "nice", "sure" ...)."""
    n = 0
    for pat in (_POSITIVE_EN, _POSITIVE_OTHER, _POSITIVE_CJK):
        for m in pat.finditer(text):
            before = text[max(0, m.start() - 24): m.start()]
            if _RELATIVE.search(before) or _NEGATOR.search(" ".join(before.split()[-3:])):
                continue
            n += not _WEAK_PRAISE.fullmatch(m.group(0))
    return n


def _count_positive(text: str) -> tuple[int, int]:
    """(plain positive cues, positive cues under a negation within 3 words before them)."""
    plain = negated = 0
    for pat in (_POSITIVE_EN, _POSITIVE_OTHER, _POSITIVE_CJK):
        for m in pat.finditer(text):
            before = text[max(0, m.start() - 24): m.start()]
            window = " ".join(before.split()[-3:])
            if _RELATIVE.search(before):
                continue
            if _NEGATOR.search(window) or before.rstrip().lower().endswith("n't"):
                negated += 1
            else:
                plain += 1
    return plain, negated


def _count(pats, text: str) -> int:
    return sum(len(p.findall(text)) for p in pats)


_NEG = (_NEGATIVE_EN, _NEGATIVE_OTHER, _NEGATIVE_CJK)


def tail_clause(text: str) -> str:
    """The text after the last contrast word ("thanks, but X" -> "X"), or "" without one. A
    contrast word closing the text ("nice! X is wrong though") marks the sentence it closes."""
    last = None
    for last in _CONTRAST.finditer(text):
        pass
    if not last:
        return ""
    after = text[last.end():].strip(" .!?,;")
    if after:
        return text[last.end():].strip()
    before = re.split(r"(?<=[.!?])\s+|[,;]\s*", text[: last.start()].strip())
    return before[-1].strip() if len(before) > 1 else ""


def read_cues(text: str, response: str = "", request: str = "") -> Cues:
    """The :class:`Cues` of a user's reply (``response``: the assistant's reply it answers, for
    :func:`conflicting_number`; ``request``: the user's request, for :func:`restates_request`)."""
    terse = 1 if _TERSE_CORRECTION.match((text or "").strip()) else 0
    t = " ".join((text or "").replace("…", " ").replace("...", " ").split())
    t = _IGNORE.sub(" ", t)
    praise_phrases = len(_PRAISE_PHRASES.findall(t))
    t_wo = _PRAISE_PHRASES.sub(" ", t)
    pos, neg_pos = _count_positive(t_wo)
    neg = _count(_NEG, t_wo) + terse
    tail = tail_clause(t_wo)
    if _CONTINUATION.match(tail):  # "but otherwise ...", "but overall ...": the praise stands
        tail = ""
    head = t_wo[: len(t_wo) - len(tail)] if tail else ""
    if _MOVING_ON.search(head):  # "great. next: X but Y": the contrast belongs to the new request
        tail = ""
    contrast_negative = bool(tail) and sum(_count_positive(head)) > 0 and (_count(_NEG, tail) > 0 or (
        not sum(_count_positive(tail)) and not _count((_HOLD, _HOLD_CJK), tail) and not tail.endswith(("?", "？"))
        and (bool(_CORRECTION_FORM.search(tail)) or len(tail.split()) >= 3)))
    stripped = t.strip()
    question = stripped.endswith(("?", "？")) or bool(_QUESTION_START.match(stripped))
    return Cues(positive=pos + praise_phrases, negative=neg, negated_positive=neg_pos,
                hold=_count((_HOLD, _HOLD_CJK), t_wo), question=question, contrast_negative=contrast_negative,
                sarcasm=len(_SARCASM.findall(t)), correction=len(_CORRECTION_FORM.findall(t_wo)),
                chars=len(stripped), trouble=len(_TROUBLE.findall(t_wo)), deferred=bool(_DEFERRED.search(t_wo)),
                strong_positive=praise_phrases + _count_strong(t_wo),
                number_conflict=conflicting_number(stripped, response),
                restatement=restates_request(stripped, request))


CUE_DIM = 12


def cue_vector(text: str) -> list[float]:
    """The cues as ``CUE_DIM`` floats (counts squashed to [0, 1); flags 0/1), for the classifier head."""
    c = read_cues(text)
    sq = lambda n: n / (n + 1.0)  # noqa: E731  0, 0.5, 0.67, ...
    return [sq(c.positive), sq(c.negative), sq(c.negated_positive), sq(c.hold), float(c.question),
            float(c.contrast_negative), sq(c.sarcasm), sq(c.correction), float(c.polarity == 1),
            float(c.polarity == -1), float(c.question and c.polarity == 0), min(c.chars, 400) / 400.0]
